"""FSDP2 sharding of a Hugging Face causal LM over the ranks of the default process group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def shard_model(model: torch.nn.Module, device_type: str = "cpu") -> torch.nn.Module:
    """Shard each decoder layer (the classes the model lists in `_no_split_modules`) and the root over all ranks.

    Gradients are summed across ranks, not averaged: each rank's loss is already its share of the global batch's
    loss (normalised by global counts), so the sum is the single-process gradient."""
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole, copied to the CPU; with a sharded model a collective that every rank calls."""
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().to("cpu", copy=True)
        for name, value in model.state_dict().items()
    }
