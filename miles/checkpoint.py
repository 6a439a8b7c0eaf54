"""Atomic checkpoint directories (safetensors + JSON, with checksums); nothing here is ever unpickled."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from miles.atomic import write_json_atomic

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
CHECKSUMS_FILE = "checksums.json"
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"


def optimizer_to_files(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    state = optimizer.state_dict()
    tensors, meta = {}, {"param_groups": state["param_groups"], "state": {}}
    for param_id, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{param_id}.{name}"] = value.detach().contiguous().cpu()
            else:
                meta["state"].setdefault(str(param_id), {})[name] = value
    save_file(tensors, str(directory / OPTIMIZER_TENSORS))
    (directory / OPTIMIZER_META).write_text(json.dumps(meta))


def optimizer_from_files(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    meta = json.loads((directory / OPTIMIZER_META).read_text())
    state: dict[int, dict[str, Any]] = {int(k): dict(v) for k, v in meta["state"].items()}
    for key, tensor in load_file(str(directory / OPTIMIZER_TENSORS)).items():
        param_id, name = key.split(".", 1)
        state.setdefault(int(param_id), {})[name] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def latest_checkpoint(root: Path) -> Path | None:
    """The intact checkpoint of the highest rollout_id.

    A damaged one (a file missing, truncated or changed since it was written) is reported and set aside as
    `<root>/damaged-<id>-<time>`, nothing deleted, and the one before it is used. `root` holds one directory per
    checkpoint, named by its rollout_id.
    """
    if not root.is_dir():
        return None
    for checkpoint in sorted((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name), reverse=True):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        aside = root / f"damaged-{checkpoint.name}-{int(time.time())}"
        os.replace(checkpoint, aside)
        log.warning(
            "checkpoint %s is damaged (%s); set aside as %s, using the one before it", checkpoint, problem, aside.name
        )
    return None


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
        if _sha256(path) != want["sha256"]:
            return f"{name} does not match its sha256"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_checksums(directory: Path) -> None:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    sums = {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    write_json_atomic(directory / CHECKSUMS_FILE, sums)


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def write_checkpoint(target: Path, rollout_id: int, state: dict[str, Any], write_files: Callable[[Path], None]) -> Path:
    """Write the checkpoint directory `target` of rollout `rollout_id`: `write_files(staging)` fills a staging dir
    beside it, then state.json (`state` and the rollout_id) and the checksums of every file, then one rename. An
    existing checkpoint (a retried save) is kept as it is."""
    if target.exists():
        return target
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    for unfinished in root.glob(f".staging-{target.name}-*"):  # an attempt that died while writing (one writer per run)
        shutil.rmtree(unfinished, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{target.name}-", dir=root))
    write_files(staging)
    write_json_atomic(staging / STATE_FILE, {**state, "rollout_id": rollout_id})
    _write_checksums(staging)
    if target.exists():  # saved meanwhile by another attempt of the same save
        shutil.rmtree(staging, ignore_errors=True)
    else:
        os.replace(staging, target)
    return target
