"""A trainer group: train.num_workers trainer actors (TrainActors, or LoRATrainActors of the multi-LoRA flow) placed by
a Ray placement group, started as one process group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from miles.cluster.actors import ActorGroup, free_address
from miles.cluster.placement import ColocatedBundles, worker_placement
from miles.config import RunConfig
from miles.train.actor import TrainActor


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
