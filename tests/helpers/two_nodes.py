"""A sync run on a simulated Ray cluster of three one-CPU nodes (miles.cluster.placement.simulated_cluster): the engine on one node,
two trainer workers spread over the other two. Run as a script (its own Ray, apart from the test session's); prints
where each actor ran and what was trained, as JSON."""

from __future__ import annotations

import json
import sys

import ray

from miles import schedules
from miles.cluster.placement import simulated_cluster
from miles.config import load_config
from miles.loop import plain_steps
from miles.run import RLRun
from miles.state.run_dir import RunDir
from tests.helpers import small_overrides


def node_of(handle) -> str:
    return ray.get(handle.__ray_call__.remote(lambda actor: ray.get_runtime_context().get_node_id()))


def main(model_dir: str, run_dir: str) -> None:
    with simulated_cluster(nodes=3, gpus_per_node=0, cpus_per_node=1) as address:
        config = load_config(
            None,
            [*small_overrides(model_dir), "train.num_workers=2", "train.placement=spread"],
            run_dir=run_dir,
            num_rollout=2,
            ray_address=address,
        )
        try:
            with RLRun(config) as run, plain_steps() as steps:
                placed = {
                    "engine_nodes": [node_of(engine) for engine in run.controller.engines],
                    "trainer_nodes": [node_of(worker) for worker in run.trainer.handles],
                    "cluster_nodes": len(ray.nodes()),
                }
                for rollout_id in schedules.sync(run, steps):
                    run.finish_iteration(rollout_id)
            placed["trained"] = sorted(RunDir(run_dir).ledger().trained)
            print(json.dumps(placed))
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
