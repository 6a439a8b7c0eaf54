"""Atomic checkpoint directories (safetensors + JSON, with checksums); nothing here is ever unpickled."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles.state.atomic import write_json_atomic

log = logging.getLogger(__name__)
# A single unsharded trainer saves and loads without a process group, as torch.distributed.checkpoint allows.
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)

STATE_FILE = "state.json"
CHECKSUMS_FILE = "checksums.json"
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
OPTIMIZER_DIR = "optimizer"
OPTIMIZER_META = "param_groups.json"
MASTER_WEIGHT = "master_weight"


def save_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, master_weights: bool = False
) -> None:
    """The optimizer's state in `directory/optimizer/`: its tensors keyed `<parameter name>/<entry>` through
    torch.distributed.checkpoint, each rank writing its own shard as safetensors (with the shard's offsets in the
    file's header, so that another number of ranks can read it), and its hyper-parameters as JSON. With
    `master_weights`, the parameters themselves too (`<name>/master_weight`): the model directory beside it holds
    them in the model's narrower dtype, and a resume continues from these. With a sharded model a collective that
    every rank calls; the directory must be the same (shared) one on every rank."""
    # Imported here, not with the module: the engines read this module's helpers, and this import takes a second of
    # every engine start.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)
    tensors, scalars = {}, {}
    for name, entries in state["state"].items():
        for entry, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{entry}"] = value
            else:
                scalars[f"{name}/{entry}"] = value
    if master_weights:
        tensors |= {f"{name}/{MASTER_WEIGHT}": p.detach() for name, p in model.named_parameters() if p.requires_grad}
    target = directory / OPTIMIZER_DIR
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(target), save_distributed=True))
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_json_atomic(target / OPTIMIZER_META, {"param_groups": state["param_groups"], "scalars": scalars})


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Restore what save_optimizer wrote, whatever number of ranks wrote it: each rank reads the slices of its own
    shards (a collective with a sharded model); saved master weights go into the parameters."""
    import torch.distributed.checkpoint as dcp  # not with the module: see save_optimizer
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    source = str(directory / OPTIMIZER_DIR)
    meta = json.loads((directory / OPTIMIZER_DIR / OPTIMIZER_META).read_text())
    parameters = dict(model.named_parameters())
    tensors = {}
    for key, stored in HuggingFaceStorageReader(source).read_metadata().state_dict_metadata.items():
        parameter = parameters[key.rsplit("/", 1)[0]]
        dtype = stored.properties.dtype
        if tuple(stored.size) == tuple(parameter.shape):  # a per-element entry: sharded as its parameter is
            tensors[key] = torch.zeros_like(parameter, dtype=dtype)
        else:
            tensors[key] = torch.zeros(stored.size, dtype=dtype, device=parameter.device)
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(source))
    state: dict[str, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        name, entry = key.rsplit("/", 1)
        if entry == MASTER_WEIGHT:
            with torch.no_grad():
                parameters[name].copy_(value)
        else:
            state.setdefault(name, {})[entry] = value
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": meta["param_groups"]})


def latest_checkpoint(root: Path) -> Path | None:
    """The intact checkpoint of the highest rollout_id.

    A damaged one (a file missing, truncated or changed since it was written) is reported and set aside as
    `<root>/damaged-<id>-<time>`, nothing deleted, and the one before it is used. `root` holds one directory per
    checkpoint, named by its rollout_id.
    """
    if not root.is_dir():
        return None
    for checkpoint in sorted((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name), reverse=True):
        if _found_intact(checkpoint) in _INTACT:
            return checkpoint
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            _INTACT.add(_found_intact(checkpoint))
            return checkpoint
        aside = root / f"damaged-{checkpoint.name}-{int(time.time())}"
        os.replace(checkpoint, aside)
        log.warning(
            "checkpoint %s is damaged (%s); set aside as %s, using the one before it", checkpoint, problem, aside.name
        )
    return None


# A committed checkpoint is never written again: one found intact is not hashed again by this process (a start reads
# it for its plan, for the trainer's restore, and again at each trainer restart; a 7B model with Adam state is ~84 GB).
# Keyed by the checksums file's identity as well, so a checkpoint replaced under the same name is checked anew.
_INTACT: set[tuple[str, int, int]] = set()


def _found_intact(checkpoint: Path) -> tuple[str, int, int]:
    try:
        stat = (checkpoint / CHECKSUMS_FILE).stat()
    except OSError:
        return (str(checkpoint), -1, -1)
    return (str(checkpoint.resolve()), stat.st_ino, stat.st_mtime_ns)


def checkpoint_problem(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint dir against its checksums.json, or None when every file is intact."""
    try:
        expected = json.loads((checkpoint / CHECKSUMS_FILE).read_text())
    except (OSError, ValueError):
        return f"{CHECKSUMS_FILE} is missing or unreadable"
    for name, want in expected.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, {want['bytes']} were written"
        if file_sha256(path) != want["sha256"]:
            return f"{name} does not match its sha256"
    return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_checksums(directory: Path) -> None:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    sums = {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files}
    write_json_atomic(directory / CHECKSUMS_FILE, sums)


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def staging_path(target: Path) -> Path:
    """Where checkpoint `target` is written before its rename: the same path for every rank of a trainer group."""
    return target.parent / f".staging-{target.name}"


def staging_dir(target: Path) -> Path:
    """An empty directory at staging_path(target); what an attempt that died while writing left there is cleared
    first (one writer per run)."""
    staging = staging_path(target)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit_checkpoint(staging: Path, target: Path, rollout_id: int, state: dict[str, Any]) -> Path:
    """Finish the checkpoint written in `staging`: state.json (`state` and the rollout_id), the checksums of every
    file, then one rename to `target`. An existing checkpoint (a retried save) is kept as it is."""
    write_json_atomic(staging / STATE_FILE, {**state, "rollout_id": rollout_id})
    _write_checksums(staging)
    if target.exists():  # saved meanwhile by another attempt of the same save
        shutil.rmtree(staging, ignore_errors=True)
    else:
        os.replace(staging, target)
    return target


def write_checkpoint_from_ranks(
    target: Path, rollout_id: int, state: dict[str, Any], rank: int, write_files: Callable[[Path], None]
) -> Path:
    """Write checkpoint `target` from every rank of a trainer group (or a single worker): rank 0 makes the staging
    dir, every rank calls `write_files(staging)` (rank 0 its own files, each rank its optimizer shard), and once all
    have written rank 0 commits it. An existing checkpoint (a retried save) is kept as it is."""
    if target.exists():
        return target
    staging = staging_dir(target) if rank == 0 else staging_path(target)
    _barrier()  # the other ranks write into the staging dir rank 0 has just made
    write_files(staging)
    _barrier()  # every rank's part is written before rank 0 takes the checksums
    if rank == 0:
        commit_checkpoint(staging, target, rollout_id, state)
    return target


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def weights_dtype(model_dir: Path) -> str:
    """The dtype of a model directory's weights, as its config.json names it (`dtype`, or the older `torch_dtype`);
    float32, transformers' default, when it names none."""
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("dtype") or config.get("torch_dtype") or "float32"


def tied_names(model: torch.nn.Module) -> set[str]:
    """The state dict's names of tensors the model ties to an earlier name (an output head tied to the embedding):
    stored and pushed once, under the earlier name, as the model declares the tie and every loader restores it."""
    seen: set[int] = set()
    tied = set()
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            tied.add(name)
        seen.add(id(value))
    return tied


def unshared(named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): each gets its own contiguous copy if needed."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in named_tensors.items():
        tensor = tensor.detach().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return tensors
