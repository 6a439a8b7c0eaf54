"""The weight-update group: the trainer's rank 0 and every engine in one torch.distributed process group of their
own, over which rank 0 broadcasts each new version of the weights (the `distributed` weight transport).

It is built as SGLang builds its side (`/init_weights_update_group`): a TCP rendezvous at rank 0's address, a
store prefixed by the group's name, and a process group apart from any default group, so a trainer rank can be in
its FSDP group and in this one at once. A bucket travels as SGLang's `load_format` says: flattened (the tensors'
bytes end to end in one uint8 tensor, in the order of the bucket's names: `"flattened_bucket"`, one collective per
bucket, what SGLang recommends) or tensor by tensor (`None`: a receiver can take each tensor straight into its
parameter, with no copy at either end).
"""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

FLATTENED = "flattened_bucket"  # SGLang's load_format for a bucket sent as one uint8 tensor

# One tensor of a bucket as the receiver needs it before the bytes arrive: (name, dtype name, shape).
TensorSpec = tuple[str, str, list[int]]


@dataclass(frozen=True)
class WeightGroup:
    """Where and how to join one weight-update group; rank 0 is the trainer's, an engine's ranks start at its
    `rank_offset` (SGLang's fields, so the spec is also the body of `/init_weights_update_group`)."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str  # gloo on CPU, nccl on CUDA
    timeout_s: float

    def request(self, rank_offset: int) -> dict:
        """The JSON body of SGLang's `/init_weights_update_group` for a server whose ranks start at `rank_offset`."""
        body = asdict(self)
        del body["timeout_s"]
        return body | {"rank_offset": rank_offset}


def rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The TCP store a process group meets at, held by rank 0 at host:port. Rank 0 listens on `host` alone: torch's
    own store (an init_method of tcp://) listens on every interface of the machine."""
    if rank:
        return dist.TCPStore(host, port, world_size, False, timeout)
    listener = socket.create_server((host, port))
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listener.detach())


def join(group: WeightGroup, rank: int) -> dist.ProcessGroup:
    """Join `group` as `rank`; blocks until every rank has joined."""
    timeout = timedelta(seconds=group.timeout_s)
    store = rendezvous_store(group.master_address, group.master_port, rank, group.world_size, timeout)
    process_group, _ = c10d._new_process_group_helper(
        group.world_size,
        rank,
        [],
        dist.Backend(group.backend),
        dist.PrefixStore(group.group_name, store),
        group_name=group.group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[process_group] = {i: i for i in range(group.world_size)}
    return process_group


def leave(process_group: dist.ProcessGroup) -> None:
    """Destroy a weight-update group, whatever state its peers left it in."""
    try:
        dist.destroy_process_group(process_group)
    except (RuntimeError, ValueError, KeyError):
        pass  # a group broken by a dead peer may be half torn down already; nothing of it is used again


class Membership:
    """This process's place in the weight-update group of the moment: a new group (a new name) is joined after the
    old one is left."""

    def __init__(self):
        self._current: tuple[str, dist.ProcessGroup] | None = None

    def of(self, group: WeightGroup, rank: int) -> dist.ProcessGroup:
        if self._current is None or self._current[0] != group.group_name:
            self.leave()
            self._current = (group.group_name, join(group, rank))
        return self._current[1]

    def leave(self) -> None:
        if self._current is not None:
            leave(self._current[1])
            self._current = None


def tensor_specs(named_tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in named_tensors.items()]


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes end to end, as one uint8 tensor on the device of the first."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unflatten(flat: torch.Tensor, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """The tensors of a flattened bucket, copied out (each byte range may be unaligned for its dtype)."""
    tensors, offset = {}, 0
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=flat.device)
        size = tensor.numel() * tensor.element_size()
        tensor.reshape(-1).view(torch.uint8).copy_(flat[offset : offset + size])
        tensors[name] = tensor
        offset += size
    if offset != flat.numel():
        raise ValueError(f"a flattened bucket of {flat.numel()} bytes does not hold its {len(specs)} tensors")
    return tensors


def send_bucket(process_group: dist.ProcessGroup, tensors: list[torch.Tensor], load_format: str | None) -> None:
    """Broadcast one bucket from rank 0: flattened into one tensor (`"flattened_bucket"`) or tensor by tensor."""
    if load_format == FLATTENED:
        dist.broadcast(flatten(tensors), group=process_group, group_src=0)
        return
    _wait_all([dist.broadcast(t.contiguous(), group=process_group, group_src=0, async_op=True) for t in tensors])


def receive_bucket(
    process_group: dist.ProcessGroup,
    specs: list[TensorSpec],
    device: torch.device,
    load_format: str | None,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Receive one bucket broadcast by rank 0. Tensor by tensor, a tensor of `into` with the spec's dtype and shape
    receives its bytes in place (no copy); the others, and a flattened bucket's, arrive in new tensors."""
    if load_format == FLATTENED:
        nbytes = sum(torch.Size(shape).numel() * getattr(torch, dtype).itemsize for _, dtype, shape in specs)
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(flat, group=process_group, group_src=0)
        return unflatten(flat, specs)
    into = into or {}
    received = {}
    for name, dtype, shape in specs:
        target = into.get(name)
        fits = (
            target is not None
            and target.dtype == getattr(torch, dtype)
            and list(target.shape) == shape
            and target.is_contiguous()
            and target.device == device
        )
        received[name] = target if fits else torch.empty(shape, dtype=getattr(torch, dtype), device=device)
    _wait_all([dist.broadcast(t, group=process_group, group_src=0, async_op=True) for t in received.values()])
    return received


def _wait_all(works: list) -> None:
    for work in works:
        work.wait()
