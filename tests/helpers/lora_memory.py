"""What a LoRA trainer worker holds in tensors, read inside its actor (`__ray_call__`)."""

from __future__ import annotations

import ray
import torch
from torch.distributed.tensor import DTensor


def held_bytes(worker) -> dict[str, int]:
    """What `worker` (a LoRATrainActor) holds: its part of the frozen base (its shards when sharded), the adapters'
    parameters and gradients, and their optimizer state."""
    base = adapters = 0
    for name, param in worker.model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        size = local.numel() * local.element_size()
        if "lora_" in name:
            adapters += size + (size if param.grad is not None else 0)
        else:
            base += size
    optimizer = sum(
        value.numel() * value.element_size()
        for adapter in worker.adapters.values()
        for state in adapter.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    return {"base": base, "adapters": adapters, "optimizer": optimizer}


def each_worker_held_bytes(group) -> list[dict[str, int]]:
    """`held_bytes` of every worker of an ActorGroup, in rank order."""
    return ray.get([handle.__ray_call__.remote(held_bytes) for handle in group.handles])
