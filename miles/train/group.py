"""A trainer group: train.num_workers trainer actors (TrainActors, or LoRATrainActors of the multi-LoRA flow) placed by
a Ray placement group, started as one process group."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.cluster import ActorGroup, free_address
from miles.config import RunConfig
from miles.placement import ColocatedBundles, on_gpus
from miles.train.actor import TrainActor

PLACEMENT_TIMEOUT_S = 120.0
STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}


def worker_bundle(config: RunConfig) -> dict[str, float]:
    """What one worker reserves: a CPU slot (torch.set_num_threads decides the real threads), and on CUDA a whole GPU
    (a colocated run's pairs share theirs: miles.placement.ColocatedBundles)."""
    bundle = {"CPU": 1.0}
    if on_gpus(config.train.device):
        bundle["GPU"] = 1.0
    return bundle


def start_trainer_group(
    config: RunConfig, model_dir: Path, checkpoint: Path | None, colocated: ColocatedBundles | None = None
) -> ActorGroup:
    """train.num_workers TrainActors from `checkpoint` (else `model_dir`)."""
    return start_worker_group(
        config, TrainActor, str(model_dir), str(checkpoint) if checkpoint else None, colocated=colocated
    )


def start_worker_group(
    config: RunConfig, actor_class: type, *args: Any, colocated: ColocatedBundles | None = None
) -> ActorGroup:
    """train.num_workers actors `actor_class(config, *args, rank, world_size, rendezvous)`, one per bundle of a
    placement group of their own (train.placement: pack or spread), or rank i in pair i's bundle of a colocated run.
    A group that cannot be placed is refused with what it asked for; a worker that fails to start fails the group
    with its error."""
    workers = config.train.num_workers
    on_bundle, release = worker_placement(config, colocated)

    rendezvous = None
    if config.train.sharded:
        host, port = ray.get(ray.remote(free_address).options(**on_bundle(0)).remote())
        rendezvous = f"{host}:{port}"
    actor = ray.remote(actor_class)
    handles = [
        actor.options(max_concurrency=1, **on_bundle(rank)).remote(config, *args, rank, workers, rendezvous)
        for rank in range(workers)
    ]
    trainers = ActorGroup(handles, release=release)
    try:
        trainers.results([handle.__ray_ready__.remote() for handle in handles])  # a worker's start error is raised
    except BaseException:
        trainers.kill()  # frees the placement group's resources, whatever the group's size
        raise
    return trainers


def worker_placement(
    config: RunConfig, colocated: ColocatedBundles | None = None
) -> tuple[Callable[[int], dict], Callable[[], None] | None]:
    """Each rank's Ray options, and what releases them: pair i's bundle of a colocated run for rank i (the run holds
    them), else a placement group of train.num_workers bundles for the group alone."""
    if colocated is not None:
        return colocated.options, None
    workers = config.train.num_workers
    bundle = worker_bundle(config)
    group = placement_group([bundle] * workers, strategy=STRATEGIES[config.train.placement])
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"train.num_workers={workers} ({config.train.placement}): Ray could not place {workers} workers of "
            f"{bundle} in {PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.available_resources()} free"
        )

    def on_bundle(index: int) -> dict:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
        return {"scheduling_strategy": strategy, "num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0)}

    return on_bundle, lambda: remove_placement_group(group)
