"""Tensors for SGLang's `/update_weights_from_tensor`, in the one format it reads: a pickled list of (name, tensor)
pairs, base64 (its MultiprocessingSerializer, unpickled by its SafeUnpickler, which admits torch's tensor and storage
rebuilders only).

CUDA tensors go as CUDA IPC handles (torch's ForkingPickler reductions): the server maps the sender's memory, so
weights are shared, not copied, and the sender keeps them alive until the server has loaded them. Their device is
named by its UUID, as SGLang's own sender names it, since the server's process may number its GPUs otherwise. CPU
tensors go as their bytes: a CPU tensor's shared-memory handle is a file descriptor fetched from the sender's
process with the sender's authentication key, which the server does not have (its scheduler dies on one).

This is the format of a request to a server this project started on 127.0.0.1; nothing here is ever read back.
"""

from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions

_DEVICE_ARGUMENT = 6  # where torch's CUDA tensor reduction puts the device index


def serialize_named_tensors(named_tensors: dict[str, torch.Tensor]) -> str:
    """The payload of one `/update_weights_from_tensor` (one tensor-parallel rank's)."""
    pairs = list(named_tensors.items())
    buffer = io.BytesIO()
    if any(tensor.is_cuda for _, tensor in pairs):
        pickler = ForkingPickler(buffer)
        pickler.dispatch_table[torch.Tensor] = _reduce_by_device_uuid  # this pickler's own copy of the table
        pickler.dump(pairs)
    else:
        pickle.dump([(name, tensor.contiguous()) for name, tensor in pairs], buffer, protocol=pickle.HIGHEST_PROTOCOL)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _reduce_by_device_uuid(tensor: torch.Tensor):
    rebuild, arguments = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        device = str(torch.cuda.get_device_properties(arguments[_DEVICE_ARGUMENT]).uuid)
        arguments = (*arguments[:_DEVICE_ARGUMENT], device, *arguments[_DEVICE_ARGUMENT + 1 :])
    return rebuild, arguments
