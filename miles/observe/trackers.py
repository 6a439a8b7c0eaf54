"""Experiment trackers (`logging.trackers`): TensorBoard, MLflow, Weights & Biases, each an optional extra.

Each record of metrics.jsonl is logged with its rollout_id as the step: an iteration's metrics under their own
names, an evaluation's as `eval/<data set>/<metric>`; the resolved config is the run's parameters, the curves are
images. metrics.jsonl is the source of truth: `<run_dir>/trackers.json` keeps each tracker's run id and last logged
step (of the iterations, and of each eval data set), so a resumed run continues the same tracker runs, first logs
the records they missed (a process that died after writing metrics.jsonl), and never logs a step twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

from miles.state.atomic import write_json_atomic
from miles.state.run_dir import RunDir, is_evaluation

log = logging.getLogger(__name__)

NOT_METRICS = ("rollout_id", "finished_at", "adapter", "eval")


class Trackers:
    """The run's trackers: `log(record)` after each metrics.jsonl line, `log_image`, `close` at the end."""

    def __init__(self, names: list[str], run_dir: RunDir, config: dict[str, Any], project: str, name: str):
        self.run_dir = run_dir
        self.state_path = run_dir.path / "trackers.json"
        self.state: dict[str, dict[str, Any]] = (
            json.loads(self.state_path.read_text()) if self.state_path.is_file() else {}
        )
        self.trackers = {
            tracker: TRACKERS[tracker](run_dir.path, config, project, name, self.state.setdefault(tracker, {}))
            for tracker in names
        }
        self._save_state()
        if self.trackers:
            for record in run_dir.records():  # what they missed when the last process stopped
                self.log(record)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["rollout_id"])
        prefix = f"eval/{record['eval']}/" if is_evaluation(record) else ""
        metrics = {
            prefix + key: float(value)
            for key, value in record.items()
            if key not in NOT_METRICS and isinstance(value, int | float) and not isinstance(value, bool)
        }
        for name, tracker in self.trackers.items():
            state = self.state[name]
            marker = _step_marker(state, record)
            if marker.get("last_step", -1) >= step:
                continue
            try:
                tracker.log(metrics, step)
            except Exception as exc:  # noqa: BLE001 - a tracker down never stops training; the next start catches up
                log.warning("%s did not take rollout %d (%s); it gets it when the run starts again", name, step, exc)
                continue
            marker["last_step"] = step
            self._save_state()

    def log_image(self, key: str, png: Path, step: int) -> None:
        for name, tracker in self.trackers.items():
            try:
                tracker.log_image(key, png, step)
            except Exception as exc:  # noqa: BLE001 - as for metrics
                log.warning("%s did not take %s: %s", name, png, exc)

    def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.close()
        self.trackers = {}

    def _save_state(self) -> None:
        if self.trackers:
            write_json_atomic(self.state_path, self.state)


class TensorBoardTracker:
    """Event files in `<run_dir>/tensorboard`; a resumed writer drops events past the last logged step."""

    def __init__(self, run_dir: Path, config: dict, project: str, name: str, state: dict):
        from torch.utils.tensorboard import SummaryWriter

        last = _last_logged_step(state)
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=None if last is None else last + 1)
        if last is None:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_image(self, key: str, png: Path, step: int) -> None:
        import matplotlib.image

        self.writer.add_image(key, matplotlib.image.imread(png)[..., :3], step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    """A run in the experiment `logging.project`, at MLFLOW_TRACKING_URI; unset, a local store in the run directory
    (`mlflow.db`, SQLite, with artifacts in `mlruns/`; MLflow no longer takes new work in a plain `mlruns` store)."""

    def __init__(self, run_dir: Path, config: dict, project: str, name: str, state: dict):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir / 'mlflow.db'}")
        if "run_id" not in state:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = (
                experiment.experiment_id
                if experiment
                else self.client.create_experiment(project, artifact_location=(run_dir / "mlruns").as_uri())
            )
            state["run_id"] = self.client.create_run(experiment_id, run_name=name).info.run_id
            for key, value in _flat(config).items():  # once: MLflow refuses to change a parameter's value
                self.client.log_param(state["run_id"], key, json.dumps(value)[:6000])
        self.run_id = state["run_id"]

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(1000 * time.time())
        finite = [Metric(key, value, stamp, step) for key, value in metrics.items() if math.isfinite(value)]
        self.client.log_batch(self.run_id, metrics=finite)

    def log_image(self, key: str, png: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(png))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """A run of the project `logging.project`, resumed by its id; WANDB_MODE=offline keeps it on disk."""

    def __init__(self, run_dir: Path, config: dict, project: str, name: str, state: dict):
        import wandb

        state.setdefault("run_id", uuid.uuid4().hex[:12])
        self.wandb = wandb
        self.run = wandb.init(
            project=project,
            name=name,
            id=state["run_id"],
            resume="allow",
            dir=str(run_dir),
            config=config,
            reinit="create_new",  # one run per adapter of a multi-LoRA run, in one process
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_image(self, key: str, png: Path, step: int) -> None:
        self.run.log({key: self.wandb.Image(str(png))}, step=step)

    def close(self) -> None:
        self.run.finish()


def _step_marker(state: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """Where the last logged step of the record's kind is kept: the tracker's state for iterations, a
    per-data-set entry under "eval" for evaluations (an evaluation at rollout N comes before iteration N)."""
    return state.setdefault("eval", {}).setdefault(record["eval"], {}) if is_evaluation(record) else state


def _last_logged_step(state: dict[str, Any]) -> int | None:
    steps = [state.get("last_step"), *(marker.get("last_step") for marker in state.get("eval", {}).values())]
    return max((s for s in steps if s is not None), default=None)


TRACKERS = {"tensorboard": TensorBoardTracker, "mlflow": MLflowTracker, "wandb": WandbTracker}


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
