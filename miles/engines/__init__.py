"""Rollout engines, chosen by `rollout.engine`: a built-in name or 'pkg.mod:Class', as algorithms are.

An engine is one class implementing `miles.engines.base.RolloutEngine` (the calls the InferenceController and the
weight transports make, the weight transports it takes, how it is launched from the config). Adding one is one
module plus one entry in BUILTINS (or none: a config names it by import path). This module imports no torch, so
the config can check names.
"""

from __future__ import annotations

from miles.registry import check_name, import_object

BUILTINS = {
    "torch": "miles.engines.torch_engine:TorchEngine",
    "sglang": "miles.engines.sglang_engine:SGLangEngine",
}


def check_engine_name(name: str) -> str:
    """`name` if `rollout.engine` may take it (the config's check; the import happens at resolve_engine)."""
    return check_name(name, list(BUILTINS))


def resolve_engine(name: str) -> type:
    """The engine class `rollout.engine` names: a built-in, or the user's `pkg.mod:Class`."""
    engine = import_object("rollout.engine", BUILTINS.get(name, name))
    if not isinstance(engine, type):
        raise ValueError(f"rollout.engine: {name!r} is not a class")
    return engine


def weight_transport(rollout, train) -> str:
    """The transport a run's weight pushes take, chosen by placement: `rollout.weight_transport`, else the engine's
    first (its own choice), or `tensor` when the engines share the trainer's GPUs and take it. An impossible one is
    refused before any work, naming the fields.

    The engines share GPUs with the trainer when both are on CUDA and an engine takes one GPU: its request is then a
    sliver of a GPU (miles.cluster.actor_options), and Ray packs it beside the trainer's rank 0. NCCL refuses a
    group with two ranks on one device, so `distributed` cannot work there; `tensor` maps the trainer's memory."""
    engine = resolve_engine(rollout.engine)
    colocated = rollout.device.startswith("cuda") and train.device.startswith("cuda") and engine.ranks(rollout) == 1
    default = "tensor" if colocated and "tensor" in engine.weight_transports else engine.weight_transports[0]
    transport = rollout.weight_transport or default
    if transport not in engine.weight_transports:
        raise ValueError(
            f"rollout.weight_transport={transport}: the {rollout.engine} engine ({engine.__name__}) takes "
            f"{' or '.join(engine.weight_transports)}"
        )
    if transport == "distributed" and colocated:
        raise ValueError(
            f"rollout.weight_transport=distributed: with rollout.device={rollout.device}, train.device={train.device} "
            f"and one GPU per engine, the engines share GPUs with the trainer's rank 0, and NCCL refuses a group with "
            f"two ranks on one GPU; use {default} (the default here)"
        )
    if transport == "tensor" and engine.ranks(rollout) != 1:
        raise ValueError(
            f"rollout.weight_transport=tensor sends one payload per bucket, for an engine of one GPU: "
            f"rollout.sglang.tp_size={engine.ranks(rollout)}; use disk or distributed"
        )
    return transport
