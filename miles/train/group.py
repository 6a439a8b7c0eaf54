"""A trainer group: train.num_workers trainer actors (TrainActors, or LoRATrainActors of the multi-LoRA flow) placed by
a Ray placement group, started as one process group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.cluster import ActorGroup, free_address
from miles.config import RunConfig
from miles.train.actor import TrainActor

PLACEMENT_TIMEOUT_S = 120.0
STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}


def worker_bundle(config: RunConfig) -> dict[str, float]:
    """What one worker reserves: a CPU slot (torch.set_num_threads decides the real threads), and on CUDA a whole GPU
    each, or a sliver of one for a single worker, so that it can share its GPU with an engine."""
    bundle = {"CPU": 1.0}
    if config.train.device.startswith("cuda"):
        bundle["GPU"] = 1.0 if config.train.num_workers > 1 else 0.01
    return bundle


def start_trainer_group(config: RunConfig, model_dir: Path, checkpoint: Path | None) -> ActorGroup:
    """train.num_workers TrainActors from `checkpoint` (else `model_dir`)."""
    return start_worker_group(config, TrainActor, str(model_dir), str(checkpoint) if checkpoint else None)


def start_worker_group(config: RunConfig, actor_class: type, *args: Any) -> ActorGroup:
    """train.num_workers actors `actor_class(config, *args, rank, world_size, rendezvous)`, one per bundle of a
    placement group (train.placement: pack or spread). A group that cannot be placed is refused with what it asked
    for; a worker that fails to start fails the group with its error."""
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

    rendezvous = None
    if config.train.sharded:
        host, port = ray.get(ray.remote(free_address).options(**on_bundle(0)).remote())
        rendezvous = f"{host}:{port}"
    actor = ray.remote(actor_class)
    handles = [
        actor.options(max_concurrency=1, **on_bundle(rank)).remote(config, *args, rank, workers, rendezvous)
        for rank in range(workers)
    ]
    trainers = ActorGroup(handles, release=lambda: remove_placement_group(group))
    try:
        trainers.results([handle.__ray_ready__.remote() for handle in handles])  # a worker's start error is raised
    except BaseException:
        trainers.kill()  # frees the placement group's resources, whatever the group's size
        raise
    return trainers
