"""A sync run on a simulated Ray cluster of three one-CPU nodes (ray.cluster_utils.Cluster): the engine on one node,
two trainer workers spread over the other two. Run as a script (its own Ray, apart from the test session's); prints
where each actor ran and what was trained, as JSON."""

from __future__ import annotations

import json
import sys

import ray
from ray.cluster_utils import Cluster

from miles import schedules
from miles.config import load_config
from miles.loop import plain_steps
from miles.run import RLRun
from miles.run_dir import RunDir
from tests.helpers import small_overrides


def node_of(handle) -> str:
    return ray.get(handle.__ray_call__.remote(lambda actor: ray.get_runtime_context().get_node_id()))


def main(model_dir: str, run_dir: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    config = load_config(
        None,
        [*small_overrides(model_dir), "train.num_workers=2", "train.placement=spread"],
        run_dir=run_dir,
        num_rollout=2,
        ray_address=cluster.address,
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
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
