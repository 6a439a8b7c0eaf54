"""Evaluate one saved checkpoint of a run, away from its training: engines of its own, started on the checkpoint's
weights, and the run's eval data sets (its config as run.json records it, with its changes). The records are those
an evaluation during training writes, at the rollout that follows the checkpoint (its weights' version), and go to
`<run_dir>/evaluations/checkpoint-<rollout_id>.json`: written once, so a second evaluation of a checkpoint (a retried
or repeated trigger) returns them without running again. The `rl-eval` flow (flows/eval.py) runs it when a checkpoint
is saved, and catches up with the run's earlier checkpoints that no trigger evaluated."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from miles.cluster.actors import ensure_ray
from miles.config import ConfigError, RunConfig, recorded_changes
from miles.evaluation.evaluate import Evaluation, load_eval_sets
from miles.rollout.inference_controller import InferenceController
from miles.state.atomic import write_json_atomic
from miles.state.checkpoint import MODEL_DIR, checkpoint_problem
from miles.state.run_dir import RunDir
from miles.weights.version import trained_version

log = logging.getLogger(__name__)


def checkpoint_run(checkpoint: str | Path) -> tuple[RunDir, int]:
    """The run directory and rollout of a model checkpoint (`<run_dir>/checkpoints/<rollout_id>`), checked intact."""
    checkpoint = Path(checkpoint).resolve()
    if not (checkpoint.name.isdigit() and checkpoint.parent.name == "checkpoints"):
        raise ConfigError(f"checkpoint: {checkpoint} is not a run's checkpoint (<run_dir>/checkpoints/<rollout_id>)")
    if not (checkpoint / MODEL_DIR).is_dir():
        raise ConfigError(f"checkpoint: {checkpoint} holds no model (an adapter's checkpoint is not evaluated alone)")
    problem = checkpoint_problem(checkpoint)
    if problem is not None:
        raise ConfigError(f"checkpoint: {checkpoint} is damaged: {problem}")
    return RunDir(checkpoint.parent.parent), int(checkpoint.name)


def recorded_run_config(run_dir: RunDir) -> RunConfig:
    recorded = run_dir.recorded_config()
    if recorded is None:
        raise ConfigError(f"checkpoint: {run_dir.path} has no run.json")
    return RunConfig.model_validate(recorded).with_changes(recorded_changes(run_dir))


def evaluations_path(run_dir: RunDir, rollout_id: int) -> Path:
    return run_dir.path / "evaluations" / f"checkpoint-{rollout_id}.json"


def evaluate_checkpoint(checkpoint: str | Path) -> list[dict[str, Any]]:
    """One record per eval data set of the run, evaluated on the checkpoint's weights."""
    run_dir, rollout_id = checkpoint_run(checkpoint)
    path = evaluations_path(run_dir, rollout_id)
    if path.exists():
        return json.loads(path.read_text())
    config = recorded_run_config(run_dir)
    eval_sets = load_eval_sets(config)
    if not eval_sets:
        raise ConfigError(f"eval.datasets: the run in {run_dir.path} has no eval data set")
    model = run_dir.checkpoint(rollout_id) / MODEL_DIR
    ensure_ray(config.ray_address, actors=config.rollout.num_engines)
    controller = InferenceController(str(model), trained_version(rollout_id), config.rollout)
    try:
        evaluation = Evaluation(config, eval_sets, controller, AutoTokenizer.from_pretrained(model))
        records = [
            {**evaluation.run(eval_set, trained_version(rollout_id)), "checkpoint": str(model.parent)}
            for eval_set in evaluation.sets
        ]
    finally:
        controller.shutdown()
    write_json_atomic(path, records)
    for record in records:
        log.info("checkpoint %d, eval %s: reward %.3f", rollout_id, record["eval"], record["reward_mean"])
    return records


def unevaluated_checkpoints(run_dir: RunDir, before: int) -> list[Path]:
    """The run's model checkpoints saved before rollout `before` that have no evaluation: their trigger was lost (an
    event the API did not store, or no rl-eval deployment served when they were saved)."""
    return [
        run_dir.checkpoint(rollout_id)
        for rollout_id in run_dir.saved_checkpoints()
        if rollout_id < before
        and (run_dir.checkpoint(rollout_id) / MODEL_DIR).is_dir()
        and not evaluations_path(run_dir, rollout_id).exists()
    ]


def checkpoint_evaluations(run_dir: RunDir) -> list[dict[str, Any]]:
    """Every checkpoint evaluation of the run so far, in rollout order."""
    directory = run_dir.path / "evaluations"
    files = (
        sorted(directory.glob("checkpoint-*.json"), key=lambda p: int(p.stem.split("-")[1]))
        if directory.is_dir()
        else []
    )
    return [record for file in files for record in json.loads(file.read_text())]
