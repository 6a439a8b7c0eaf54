"""RunDir: the one owner of a run directory's layout and of the files in it.

    <run_dir>/
        run.json            the config, the starting model, package versions, one entry per start
        run.lock            the lease of the process training the run (miles.state.run_lock)
        ledger.jsonl        the rollouts trained, with their metrics, a line each
        metrics.jsonl       one line per finished iteration and per evaluation of an eval data set
        rollouts/           rollout_<id>.arrow (RolloutStore)
        checkpoints/<id>/   model or adapter, optimizer, state.json (miles.state.checkpoint)
        adapters/<name>/    one adapter's own run directory (multi-LoRA)
        engine_weights/<v>/ the weights last pushed to the engines (rollout.weight_transport: disk)
        reward_curve.png
        eval_<name>.png     the curve of each eval data set

It imports nothing heavy: the config names adapter directories through it. The files' formats live with their
code (miles.state.checkpoint, miles.rollout.store); the run directory says where they go.
"""

from __future__ import annotations

import json
import logging
import os
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from miles.state.atomic import atomic_file, write_json_atomic
from miles.state.run_lock import RunLock

log = logging.getLogger(__name__)

PACKAGES = ("miles-flow", "torch", "transformers", "ray", "pyarrow", "prefect", "sglang")


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def checkpoint(self, rollout_id: int) -> Path:
        return self.checkpoints / str(rollout_id)

    def saved_checkpoints(self) -> list[int]:
        """The rollout ids of the checkpoint directories, in order (intact or not)."""
        root = self.checkpoints
        return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []

    @property
    def engine_weights(self) -> Path:
        return self.path / "engine_weights"

    @property
    def rollouts(self) -> Path:
        return self.path / "rollouts"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def record_path(self) -> Path:
        return self.path / "run.json"

    @property
    def reward_curve_path(self) -> Path:
        return self.path / "reward_curve.png"

    @property
    def adapters_path(self) -> Path:
        """Where a multi-LoRA run keeps each adapter's own run directory."""
        return self.path / "adapters"

    def adapter(self, name: str) -> RunDir:
        return RunDir(self.adapters_path / name)

    def critic(self) -> RunDir:
        """The critic's own checkpoints and ledger (algo.advantage_estimator=gae)."""
        return RunDir(self.path / "critic")

    def create(self) -> RunDir:
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    def lock(self) -> RunLock:
        return RunLock(self.lock_path)

    def ledger(self) -> Ledger:
        """The ledger as it is on disk now (the trainer actor writes it from its own process)."""
        return Ledger(self.path / "ledger.jsonl", older=self.path / "ledger.json")

    # metrics.jsonl: one line per finished iteration, appended once per rollout_id, and one per evaluation of an
    # eval data set (its "eval" field names the data set), appended once per (rollout_id, data set).

    def records(self) -> list[dict[str, Any]]:
        """Every line of metrics.jsonl: iterations and evaluations."""
        if not self.metrics_path.exists():
            return []
        records = []
        for number, line in enumerate(self.metrics_path.read_bytes().splitlines(), start=1):
            try:
                records.append(json.loads(line))
            except ValueError:  # a line a crash cut short (the start rewrites the file without it)
                log.warning("%s: line %d is cut short or damaged; it is left out", self.metrics_path, number)
        return records

    def metrics(self) -> list[dict[str, Any]]:
        """The iterations' records."""
        return [r for r in self.records() if not is_evaluation(r)]

    def evaluations(self, dataset: str | None = None) -> list[dict[str, Any]]:
        """The evaluations' records (of one eval data set, if given)."""
        return [r for r in self.records() if is_evaluation(r) and dataset in (None, r["eval"])]

    def keep_metrics_before(self, rollout_id: int) -> list[dict[str, Any]]:
        """Drop the lines of iterations from `rollout_id` on (they will be trained again) and of evaluations after it
        (they will be run again: the one at `rollout_id` was on the weights the run resumes with); return the rest."""
        records = self.records()
        kept = [r for r in records if r["rollout_id"] < rollout_id + is_evaluation(r)]
        content = self.metrics_path.read_bytes() if self.metrics_path.exists() else b""
        if len(kept) != len(content.splitlines()) or content and not content.endswith(b"\n"):  # dropped, or cut short
            with atomic_file(self.metrics_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
        return kept

    def append_metrics(self, record: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def eval_curve_path(self, dataset: str) -> Path:
        return self.path / f"eval_{dataset}.png"

    # run.json: what the run started from, and every start with its config.

    @property
    def lock_path(self) -> Path:
        return self.path / "run.lock"

    def _record(self) -> dict[str, Any] | None:
        return json.loads(self.record_path.read_text()) if self.record_path.exists() else None

    def has_trained(self) -> bool:
        return bool(self.ledger().trained) or _holds_files(self.checkpoints)

    def has_work(self) -> bool:
        """Whether a start has left anything of the run: a trained rollout, a checkpoint, a stored rollout."""
        return self.has_trained() or _holds_files(self.rollouts)

    def pinned_initial_model(self) -> Path | None:
        """The model the run started from, once a start has trained on it; a start that trained nothing pins none."""
        record = self._record()
        return Path(record["initial_model"]) if record is not None and self.has_trained() else None

    def recorded_config(self) -> dict[str, Any] | None:
        """The config of the last start (its JSON form)."""
        record = self._record()
        return record["config"] if record else None

    def record_change(self, change: dict[str, Any]) -> None:
        """A change of config values made in the middle of the run (ConfigChange's JSON form), kept for every later
        start: run.json's `changes`."""
        record = self._record() or {"starts": []}
        record.setdefault("changes", []).append(change)
        write_json_atomic(self.record_path, record)

    def recorded_changes(self) -> list[dict[str, Any]]:
        record = self._record()
        return record.get("changes", []) if record else []

    def record_start(self, config: dict[str, Any], initial_model: Path, start: dict[str, Any]) -> None:
        record = self._record() or {"starts": []}
        record.update(config=config, initial_model=str(initial_model), versions=package_versions())
        record["starts"].append({"time": time.time(), **start, "config": config})
        write_json_atomic(self.record_path, record)

    def record_placement(self, placement: dict[str, Any]) -> None:
        """Where this start's actors landed (miles.cluster.placement.PlacementRecord), beside its config."""
        record = self._record()
        record["starts"][-1]["placement"] = placement
        write_json_atomic(self.record_path, record)


def _holds_files(directory: Path) -> bool:
    return directory.is_dir() and any(directory.iterdir())


def is_evaluation(record: dict[str, Any]) -> bool:
    return "eval" in record


def package_versions() -> dict[str, str]:
    """The installed versions of the packages a run depends on."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


class Ledger:
    """Which rollout_ids were trained, with their metrics: ledger.jsonl, one line appended per trained rollout, so
    that recording costs the same at rollout 10 and at rollout 100,000 (rewriting one file of every entry grew with
    the run). A line a crash cut short is skipped on reading: its rollout counts as untrained and is trained again
    from the checkpoint, once. A ledger.json of an older run is read first."""

    def __init__(self, path: Path, older: Path | None = None):
        self.path = path
        self.older = older
        self.trained: dict[int, dict[str, float]] = {}
        if older is not None and older.exists():
            self.trained = {int(k): v for k, v in json.loads(older.read_text())["trained"].items()}
        if self.path.exists():
            for line in self.path.read_bytes().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                self.trained[entry["rollout_id"]] = entry["metrics"]

    def record(self, rollout_id: int, metrics: dict[str, float]) -> None:
        self.trained[rollout_id] = metrics
        line = json.dumps({"rollout_id": rollout_id, "metrics": metrics}).encode() + b"\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a+b") as f:
            if f.tell():
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # the end of a line a crash cut short: start a line of our own
                    line = b"\n" + line
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def forget_after(self, rollout_id: int) -> list[int]:
        """Drop entries whose weights were lost (trained after the checkpoint a run resumes from)."""
        lost = sorted(k for k in self.trained if k > rollout_id)
        for k in lost:
            del self.trained[k]
        if lost:
            with atomic_file(self.path, "w") as f:
                f.writelines(
                    json.dumps({"rollout_id": k, "metrics": v}) + "\n" for k, v in sorted(self.trained.items())
                )
            if self.older is not None:
                self.older.unlink(missing_ok=True)  # its entries are in the new file now
        return lost
