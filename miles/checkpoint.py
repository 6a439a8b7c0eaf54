"""Atomic checkpoints (safetensors + JSON) and the run ledger; nothing here is ever unpickled."""

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

from miles.atomic import atomic_file

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
CHECKSUMS_FILE = "checksums.json"
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"


def write_json_atomic(path: Path, data: Any) -> None:
    with atomic_file(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


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


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_dir(run_dir: str | Path, rollout_id: int) -> Path:
    return checkpoint_root(run_dir) / str(rollout_id)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The intact checkpoint of the highest rollout_id.

    A damaged one (a file missing, truncated or changed since it was written) is reported and set aside as
    `checkpoints/damaged-<id>-<time>`, nothing deleted, and the one before it is used.
    """
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None
    for checkpoint in sorted((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name), reverse=True):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        aside = root / f"damaged-{checkpoint.name}-{int(time.time())}"
        os.replace(checkpoint, aside)
        log.warning("checkpoint %s is damaged (%s); set aside as %s, using the one before it", checkpoint, problem, aside.name)
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


def write_checkpoint(run_dir: str | Path, rollout_id: int, state: dict[str, Any], write_files: Callable[[Path], None]) -> Path:
    """Write <run_dir>/checkpoints/<rollout_id>/: `write_files(staging)` fills a staging dir, then state.json and
    the checksums of every file, then one rename. An existing checkpoint (a retried save) is kept as it is."""
    target = checkpoint_dir(run_dir, rollout_id)
    if target.exists():
        return target
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for unfinished in root.glob(f".staging-{rollout_id}-*"):  # an attempt that died while writing (one writer per run)
        shutil.rmtree(unfinished, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{rollout_id}-", dir=root))
    write_files(staging)
    write_json_atomic(staging / STATE_FILE, {**state, "rollout_id": rollout_id})
    _write_checksums(staging)
    if target.exists():  # saved meanwhile by another attempt of the same save
        shutil.rmtree(staging, ignore_errors=True)
    else:
        os.replace(staging, target)
    return target


class Ledger:
    """Which rollout_ids were trained, with their metrics: <run_dir>/ledger.json."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "ledger.json"
        self.trained: dict[int, dict[str, float]] = {}
        if self.path.exists():
            self.trained = {int(k): v for k, v in json.loads(self.path.read_text())["trained"].items()}

    def record(self, rollout_id: int, metrics: dict[str, float]) -> None:
        self.trained[rollout_id] = metrics
        self._save()

    def forget_after(self, rollout_id: int) -> list[int]:
        """Drop entries whose weights were lost (trained after the checkpoint a run resumes from)."""
        lost = sorted(k for k in self.trained if k > rollout_id)
        for k in lost:
            del self.trained[k]
        if lost:
            self._save()
        return lost

    def _save(self) -> None:
        write_json_atomic(self.path, {"trained": {str(k): v for k, v in sorted(self.trained.items())}})


class RunLock:
    """<run_dir>/run.lock holds the pid of the process training the run; a second process is refused.

    A lock whose pid is dead (a killed process) is taken over with a warning.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "run.lock"
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and _alive(holder):
                    raise RuntimeError(f"{self.path.parent} is being trained by process {holder} (lock {self.path})") from None
                log.warning("taking over the stale lock %s of process %s", self.path, holder)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            return

    def _holder(self) -> int | None:
        try:
            return int(self.path.read_text().strip())
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self._holder() == os.getpid():
            self.path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
