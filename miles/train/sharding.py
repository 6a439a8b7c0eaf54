"""FSDP2 sharding of a Hugging Face causal LM over the ranks of the default process group, and its full weights."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from miles.state.checkpoint import tied_names
from miles.weights.group import TensorSpec, rendezvous_store, tensor_specs

# A rank that waits this long in a collective has lost its group; the group is restarted as a whole anyway.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def join_trainer_group(device: torch.device, rendezvous: str, rank: int, world_size: int) -> None:
    """Join the trainer group's default process group (NCCL on CUDA, gloo on CPU) through `rendezvous`, `host:port` on
    rank 0's node."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    host, port = rendezvous.rsplit(":", 1)
    store = rendezvous_store(host, int(port), rank, world_size, COLLECTIVE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)


def shard_model(model: torch.nn.Module, device_type: str = "cpu", param_dtype: str = "float32") -> torch.nn.Module:
    """Shard each decoder layer (the classes the model lists in `_no_split_modules`) and the root over all ranks.

    The sharded parameters, their gradients and the optimizer state stay float32; with `param_dtype` bfloat16 the
    layers compute on bfloat16 copies gathered for the forward and backward, and gradients are reduced in float32
    (FSDP2's MixedPrecisionPolicy).

    The model may be on the CPU: FSDP2 moves each module's parameters to the device of the mesh as it shards them,
    so a GPU holds one layer whole at most, never the whole model.

    Gradients are summed across ranks, not averaged: each rank's loss is already its share of the global batch's
    loss (normalised by global counts), so the sum is the single-process gradient."""
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum
    return model


def full_tensor_buckets(
    model: torch.nn.Module, bucket_bytes: int, device: torch.device | str = "cpu", copy: bool = True
) -> Iterator[dict[str, torch.Tensor]]:
    """The model's parameters and buffers whole, on `device`, a bucket of at most `bucket_bytes` at a time (a tensor
    larger than that is a bucket of its own). With `copy` false, an unsharded tensor already on `device` is the
    model's own (for a caller that only reads it before the next step). On the GPU a bucket's gathers run together;
    only one bucket of full tensors is on the model's device at once. With a sharded model every rank must iterate:
    each gather is a collective."""
    for bucket in _buckets(model, bucket_bytes):
        yield _gathered(bucket, device, copy)


def bucket_specs(model: torch.nn.Module, bucket_bytes: int, dtype: str | None = None) -> list[list[TensorSpec]]:
    """(name, dtype, full shape) of the tensors of each bucket `full_tensor_buckets` yields, without gathering; with
    `dtype`, as sent cast to it."""
    specs = [tensor_specs(dict(bucket)) for bucket in _buckets(model, bucket_bytes)]
    return [[(name, dtype or kind, shape) for name, kind, shape in bucket] for bucket in specs]


def _buckets(model: torch.nn.Module, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The state dict's tensors in buckets, less those tied to an earlier one (`tied_names`)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    tied = tied_names(model)
    for name, value in model.state_dict(keep_vars=True).items():
        if name in tied:
            continue
        nbytes = value.numel() * value.element_size()  # a DTensor's numel is the full tensor's
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, value.detach()))
        size += nbytes
    if bucket:
        yield bucket


def _gathered(
    bucket: list[tuple[str, torch.Tensor]], device: torch.device | str, copy: bool
) -> dict[str, torch.Tensor]:
    pending = [
        (
            name,
            value.redistribute(
                placements=[Replicate()] * value.device_mesh.ndim, async_op=value.device.type != "cpu"
            ).to_local(),
            True,
        )
        if isinstance(value, DTensor)
        else (name, value, False)
        for name, value in bucket
    ]
    # On the GPU a gathered tensor is still in flight until read: the copy waits for it. On the CPU (gloo) each gather
    # finishes before the next starts: several in flight at once corrupted the heap (glibc "unaligned tcache chunk",
    # SIGABRT) within seconds in a loop of full_state_dict over two ranks. A plain tensor is the model's own.
    return {name: value.detach().to(device, copy=copy or gathered) for name, value, gathered in pending}


def full_state_dict(model: torch.nn.Module, bucket_bytes: int) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole, copied to the CPU; with a sharded model a collective that every rank calls."""
    weights: dict[str, torch.Tensor] = {}
    for bucket in full_tensor_buckets(model, bucket_bytes):
        weights.update(bucket)
    return weights
