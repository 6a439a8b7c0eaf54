"""Tensors for SGLang's `/update_weights_from_tensor`, in the format it reads with `load_format` "flattened_bucket":
a bucket is one uint8 tensor holding every tensor's bytes, with a record per tensor (name, shape, dtype, byte range),
pickled and base64 (SGLang's MultiprocessingSerializer, unpickled by its SafeUnpickler, which admits torch's tensor
and storage rebuilders, torch's sizes and dtypes, and `types.SimpleNamespace`, the records' type here: SGLang reads
their attributes).

CUDA tensors go as CUDA IPC handles (torch's ForkingPickler reductions): the server maps the sender's memory, so
weights are shared, not copied, and the sender keeps them alive until the server has loaded them; a flattened bucket
is one handle for the bucket, where a list of tensors is one per tensor. Their device is named by its UUID, as
SGLang's own sender names it, since the server's process may number its GPUs otherwise. CPU tensors go as their
bytes: a CPU tensor's shared-memory handle is a file descriptor fetched from the sender's process with the sender's
authentication key, which the server does not have (its scheduler dies on one).

This is the format of a request to a server this project started on 127.0.0.1; nothing here is ever read back.
"""

from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import torch
from torch.multiprocessing import reductions

_DEVICE_ARGUMENT = 6  # where torch's CUDA tensor reduction puts the device index
_ALIGNMENT = 16  # bytes: every dtype's size divides it


def serialize_bucket(
    named_tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> tuple[str, torch.Tensor]:
    """The payload of one `/update_weights_from_tensor` (one tensor-parallel rank's), load_format "flattened_bucket":
    the bucket's tensors cast to `dtype` (unset: their own) into one new uint8 tensor on their device, which it
    returns too: on the GPU the payload points to it, and the caller keeps it until the server has loaded it."""
    flat, records = _flattened(named_tensors, dtype)
    buffer = io.BytesIO()
    payload = {"flattened_tensor": flat, "metadata": records}
    if flat.is_cuda:
        pickler = ForkingPickler(buffer)
        pickler.dispatch_table[torch.Tensor] = _reduce_by_device_uuid  # this pickler's own copy of the table
        pickler.dump(payload)
    else:
        pickle.dump(payload, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    return base64.b64encode(buffer.getvalue()).decode("ascii"), flat


def _flattened(
    named_tensors: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> tuple[torch.Tensor, list[SimpleNamespace]]:
    """The tensors' bytes in one uint8 tensor, each starting at an offset aligned for its dtype (SGLang views each
    byte range as its dtype, which needs the alignment), cast on the way in; and SGLang's record of each."""
    records, offset = [], 0
    for name, tensor in named_tensors.items():
        kind = dtype or tensor.dtype
        offset = -(-offset // _ALIGNMENT) * _ALIGNMENT
        size = tensor.numel() * kind.itemsize
        records.append(
            SimpleNamespace(
                name=name, shape=tensor.shape, dtype=kind, start_idx=offset, end_idx=offset + size, numel=size
            )
        )
        offset += size
    first = next(iter(named_tensors.values()))
    flat = torch.empty(offset, dtype=torch.uint8, device=first.device)
    for record, tensor in zip(records, named_tensors.values(), strict=True):
        flat[record.start_idx : record.end_idx].view(record.dtype).view(record.shape).copy_(tensor)
    return flat, records


def _reduce_by_device_uuid(tensor: torch.Tensor):
    rebuild, arguments = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        device = str(torch.cuda.get_device_properties(arguments[_DEVICE_ARGUMENT]).uuid)
        arguments = (*arguments[:_DEVICE_ARGUMENT], device, *arguments[_DEVICE_ARGUMENT + 1 :])
    return rebuild, arguments
