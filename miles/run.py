"""RLRun: one run's pieces (run dir, model, engine and trainer actors), resumed from the run directory.

Flows and the plain loop drive the same calls: generate -> get -> train -> sync_weights per rollout_id,
then save_checkpoint when due and finish_iteration. Each call is idempotent per rollout_id.

`PolicyRun` is what those calls share with one adapter of the multi-LoRA run (miles.multi_lora): a directory
with its checkpoints, ledger, rollouts and metrics, resumed after its latest checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from importlib import metadata
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import ray
from transformers import AutoConfig, AutoTokenizer

from miles.checkpoint import MODEL_DIR, Ledger, RunLock, checkpoint_dir, latest_checkpoint, read_state, write_json_atomic
from miles.cluster import RestartableActor, actor_options, ensure_ray
from miles.config import ConfigError, RunConfig
from miles.data import DataSource, check_prompt_lengths, load_rows
from miles.evaluate import evaluate_checkpoint
from miles.models import ensure_embedded_model
from miles.plots import plot_reward_curve
from miles.progress import IterationReporter
from miles.rewards import RewardFn, resolve_reward
from miles.rollout.inference_controller import InferenceController
from miles.rollout.rollout_executor import RolloutExecutor, summarize
from miles.rollout.schema import rollout_metadata
from miles.rollout.store import RolloutStore
from miles.train.actor import TrainActor

log = logging.getLogger(__name__)

PACKAGES = ("miles-flow", "torch", "transformers", "ray", "pyarrow", "prefect", "sglang")


def _versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def check_inputs(config: RunConfig) -> tuple[list[dict[str, str]], RewardFn]:
    """Load the dataset and resolve the reward: everything that can reject the input, before any work."""
    if config.model.path is None and config.data.task is None:
        raise ConfigError("model.path: the embedded model is built for a built-in task; set data.task or model.path")
    try:
        return load_rows(config.data), resolve_reward(config.data.reward)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_context(config: RunConfig, rows: list[dict[str, str]], tokenizer, model: Path) -> None:
    """Every prompt plus rollout.max_new_tokens must fit the model's context (before any work starts)."""
    context = AutoConfig.from_pretrained(model).max_position_embeddings
    source = config.data.path or f"task {config.data.task}"
    try:
        check_prompt_lengths(rows, tokenizer, config.rollout.max_new_tokens, context, source)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def initial_model(run_dir: Path, config: RunConfig, tasks: list[str]) -> Path:
    """The run's starting model: as recorded in run.json, else model.path, else the embedded model for `tasks`."""
    record = run_dir / "run.json"
    if record.exists():
        return Path(json.loads(record.read_text())["initial_model"])
    if config.model.path:
        return Path(config.model.path)
    return ensure_embedded_model(config.model, tasks, config.seed)


def write_run_record(run_dir: Path, config: RunConfig, model: Path, start: dict[str, Any]) -> None:
    """run.json: the config, the starting model, package versions, and one entry per start of the run."""
    path = run_dir / "run.json"
    record = json.loads(path.read_text()) if path.exists() else {"starts": []}
    record.update(config=config.model_dump(mode="json"), initial_model=str(model), versions=_versions())
    record["starts"].append({"time": time.time(), **start})
    write_json_atomic(path, record)


def check_off_policy_correction(config: RunConfig) -> None:
    """Training one step off-policy (the async flow) needs a correction for the stale rollout log-probs."""
    if not (config.algo.use_tis or config.algo.use_rollout_logprobs):
        raise ConfigError("the async flow trains off-policy: set algo.use_tis=true or algo.use_rollout_logprobs=true")


def _saved_rollout_id(checkpoint: Path | None) -> int:
    """The last rollout a checkpoint holds; -1 without one."""
    return read_state(checkpoint)["rollout_id"] if checkpoint else -1


class PolicyRun:
    """One policy's directory (the full model, or one adapter): resume state, rollouts, metrics and progress.

    `label` prefixes its task run names in the UI; subclasses add the trainer and weight calls.
    """

    label = ""

    def _resume(self, config: RunConfig) -> Path | None:
        """Read the latest intact checkpoint and the rollouts trained after it (to be replayed onto it by the
        trainer, see `_replay`); drop metrics of rollouts that will be trained again. Returns the checkpoint."""
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = latest_checkpoint(self.run_dir)
        self.resume_state = read_state(checkpoint) if checkpoint else None
        self.store = RolloutStore(self.run_dir)
        self.replayed_at_start = self._trained_since(checkpoint)
        self.start_rollout_id = _saved_rollout_id(checkpoint) + 1 + len(self.replayed_at_start)
        # Rollouts trained so far; the trainer is at version rollout_id + 1 after training rollout_id.
        self.trainer_version = self.start_rollout_id
        self._recorded_ids = self._truncate_metrics()
        self._timings: dict[int, dict[str, float]] = {}
        self._summaries: dict[int, dict[str, Any]] = {}
        self._metrics: dict[int, dict[str, float]] = {}
        return checkpoint

    def _trained_since(self, checkpoint: Path | None) -> list[int]:
        """The rollouts trained after `checkpoint` (the ledger lists them), in order, up to the first whose stored file
        is gone; the run trains the ones after a missing file anew."""
        last_saved = _saved_rollout_id(checkpoint)
        trained = sorted(k for k in Ledger(self.run_dir).trained if k > last_saved)
        replay = []
        for rollout_id in trained:
            if rollout_id != last_saved + 1 + len(replay) or not self.store.exists(rollout_id):
                log.warning("%srollouts %s cannot be replayed (rollout %d is not stored); they will be trained anew",
                            self.label, trained[len(replay):], rollout_id)
                break
            replay.append(rollout_id)
        return replay

    def _take_replay(self, checkpoint: Path | None) -> list[int]:
        """`_trained_since(checkpoint)`, taken out of the ledger: the trainer records each again as it re-trains it.
        Call it before the trainer reads the ledger."""
        replay = self._trained_since(checkpoint)
        Ledger(self.run_dir).forget_after(_saved_rollout_id(checkpoint))
        return replay

    def _replay(self, train_on: Callable[[int, pa.Table], dict[str, float]], rollout_ids: list[int]) -> None:
        """Train a restored trainer on `rollout_ids` again, in order, from their stored files: with the same tables
        (each handed over at trainer version rollout_id, as when first trained) the weights come out as they were."""
        for rollout_id in rollout_ids:
            table, _ = self.executor.get(rollout_id, trainer_version=rollout_id)
            train_on(rollout_id, table)
        if rollout_ids:
            log.warning("%sre-trained rollouts %s from their stored files onto the latest checkpoint", self.label, rollout_ids)

    def _finish_replayed(self) -> None:
        """After the start-up replay: the data cursor goes past the replayed rollouts, and a replayed rollout whose
        metrics line was never written (the process died after training it) gets one."""
        if not self.replayed_at_start:
            return
        ledger = Ledger(self.run_dir)
        for rollout_id in self.replayed_at_start:
            table = self.store.read(rollout_id)
            self.data_source.position = int(rollout_metadata(table)["data_position_end"])
            if rollout_id not in self._recorded_ids:
                self._summaries[rollout_id] = summarize(table)
                self._metrics[rollout_id] = ledger.trained[rollout_id]
                self._append_metrics(self._iteration_record(rollout_id))

    def _start_rollouts(self, controller: InferenceController, tokenizer, rows, reward_fn: RewardFn, adapter: str | None = None) -> None:
        self.data_source = DataSource(rows, seed=self.config.seed, shuffle=self.config.data.shuffle)
        if self.resume_state:
            self.data_source.load_state_dict(self.resume_state["data"])
        self.executor = RolloutExecutor(self.config, controller, tokenizer, self.data_source, self.store, reward_fn, adapter)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def _truncate_metrics(self) -> set[int]:
        """Drop metrics.jsonl lines of rollouts that will be trained again; return the rollout_ids kept."""
        if not self.metrics_path.exists():
            return set()
        lines = self.metrics_path.read_text().splitlines()
        kept = [line for line in lines if json.loads(line)["rollout_id"] < self.start_rollout_id]
        if len(kept) != len(lines):
            self.metrics_path.write_text("".join(line + "\n" for line in kept))
        return {json.loads(line)["rollout_id"] for line in kept}

    def rollout_ids(self) -> range:
        """The rollouts this run trains: up to num_rollout, at most iterations_per_run of them."""
        per_run = self.config.iterations_per_run or self.config.num_rollout
        return range(self.start_rollout_id, min(self.config.num_rollout, self.start_rollout_id + per_run))

    def _timed(self, rollout_id: int, phase: str, started: float) -> None:
        self._timings.setdefault(rollout_id, {})[f"time_{phase}"] = time.perf_counter() - started

    def generate(self, rollout_id: int) -> dict[str, Any]:
        started = time.perf_counter()
        summary = self.executor.generate(rollout_id)
        self._summaries.setdefault(rollout_id, {}).update(summary)
        self._timed(rollout_id, "generate", started)
        return summary

    def get(self, rollout_id: int) -> pa.Table:
        started = time.perf_counter()
        table, stats = self.executor.get(rollout_id, self.trainer_version)
        self._summaries.setdefault(rollout_id, {}).update(stats)
        self._timed(rollout_id, "get", started)
        return table

    def train(self, rollout_id: int, table: pa.Table) -> dict[str, float]:
        started = time.perf_counter()
        metrics = self._train(rollout_id, table)
        self._metrics[rollout_id] = metrics
        self.trainer_version = rollout_id + 1
        self._timed(rollout_id, "train", started)
        return metrics

    def _train(self, rollout_id: int, table: pa.Table) -> dict[str, float]:
        raise NotImplementedError

    def should_save(self, rollout_id: int) -> bool:
        """Every save_interval, and at the end of this run (the next run resumes from there)."""
        return (rollout_id + 1) % self.config.save_interval == 0 or rollout_id == self.rollout_ids().stop - 1

    def _checkpoint_state(self, rollout_id: int) -> dict[str, Any]:
        return {"weight_version": rollout_id + 1, "data": self.data_source.state_dict(), "seed": self.config.seed}

    def finish_iteration(self, rollout_id: int) -> dict[str, Any]:
        """Append the iteration's record to metrics.jsonl (once per rollout_id) and report progress."""
        record = self._iteration_record(rollout_id)
        self._append_metrics(record)
        self.reporter.update_record(record)
        return record

    def _iteration_record(self, rollout_id: int) -> dict[str, Any]:
        return {
            "rollout_id": rollout_id,
            **({"adapter": self.executor.adapter} if self.executor.adapter else {}),
            "finished_at": time.time(),
            **self._summaries.pop(rollout_id, {}),
            **self._metrics.pop(rollout_id, {}),
            **{f"time_{p}": 0.0 for p in ("generate", "get", "train", "sync")},
            **self._timings.pop(rollout_id, {}),
        }

    def _append_metrics(self, record: dict[str, Any]) -> None:
        if record["rollout_id"] not in self._recorded_ids:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            self._recorded_ids.add(record["rollout_id"])

    def plot_reward_curve(self) -> Path:
        """<run_dir>/reward_curve.png from metrics.jsonl (the whole run, every start)."""
        return plot_reward_curve(self.metrics_path, self.run_dir / "reward_curve.png")


class RLRun(PolicyRun):
    """Full-model RL: one TrainActor, engines that take full weight pushes.

    A trainer that dies is started again on the next call (the task's retry): from the latest intact checkpoint,
    then re-trained on the rollouts trained since, so it holds the weights it had.
    """

    def __init__(self, config: RunConfig):
        rows, reward_fn = check_inputs(config)
        Path(config.run_dir).mkdir(parents=True, exist_ok=True)
        self.lock = RunLock(config.run_dir)
        self.trainer = self.controller = self.reporter = None
        try:
            self.initial_model = initial_model(Path(config.run_dir), config, [config.data.task])
            tokenizer = AutoTokenizer.from_pretrained(self.initial_model)
            check_context(config, rows, tokenizer, self.initial_model)
            checkpoint = self._resume(config)
            write_run_record(self.run_dir, config, self.initial_model, {
                "rollout_id": self.start_rollout_id, "checkpoint": str(checkpoint) if checkpoint else None,
                "replayed": self.replayed_at_start,
            })
            ensure_ray(config.ray_address, actors=config.ray_actors)
            saved_version = self.resume_state["weight_version"] if self.resume_state else 0
            engine_model = checkpoint / MODEL_DIR if checkpoint else self.initial_model
            self.controller = InferenceController(str(engine_model), saved_version, config.rollout)
            self._start_rollouts(self.controller, tokenizer, rows, reward_fn)
            self.trainer = RestartableActor("trainer", self._start_trainer)
            self._finish_replayed()
            if self.trainer_version != saved_version:  # the replayed rollouts moved the trainer past the checkpoint
                self.trainer.hand_over("weights", to=lambda weights: self.controller.update_weights(weights, self.trainer_version))
            self.reporter = IterationReporter(config.num_rollout, self.start_rollout_id)
        except BaseException:
            self.close()
            raise

    def _start_trainer(self) -> ray.actor.ActorHandle:
        """A TrainActor from the latest intact checkpoint, re-trained on the rollouts trained after it."""
        checkpoint = latest_checkpoint(self.run_dir)
        replay = self._take_replay(checkpoint)
        trainer = ray.remote(TrainActor).options(**actor_options(self.config.train.device)).remote(
            self.config, str(self.initial_model), str(checkpoint) if checkpoint else None, self.config.train.device
        )
        self._replay(lambda rollout_id, table: ray.get(trainer.train.remote(rollout_id, table)), replay)
        return trainer

    def _train(self, rollout_id: int, table: pa.Table) -> dict[str, float]:
        return self.trainer.call("train", rollout_id, table)

    def sync_weights(self, rollout_id: int) -> int:
        """Push the weights trained on `rollout_id` to every engine as version rollout_id + 1."""
        started = time.perf_counter()
        version = rollout_id + 1
        self.trainer.hand_over("weights", to=lambda weights: self.controller.update_weights(weights, version))
        self._timed(rollout_id, "sync", started)
        return version

    def should_sync(self, rollout_id: int) -> bool:
        return (rollout_id + 1) % self.config.update_weights_interval == 0 or rollout_id == self.config.num_rollout - 1

    def save_checkpoint(self, rollout_id: int) -> str:
        return self.trainer.call("save_checkpoint", rollout_id, self._checkpoint_state(rollout_id))

    def evaluate(self, rollout_id: int, prompts: int = 200) -> dict[str, float]:
        """Greedy accuracy (plain transformers) of the starting model and of checkpoint `rollout_id`."""
        if self.config.data.task is None:
            return {}
        checkpoint = checkpoint_dir(self.run_dir, rollout_id) / MODEL_DIR
        return {
            "greedy_accuracy_initial": evaluate_checkpoint(self.initial_model, self.config.data.task, prompts),
            "greedy_accuracy_final": evaluate_checkpoint(checkpoint, self.config.data.task, prompts),
        }

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()
        if self.controller is not None:
            self.controller.shutdown()
        if self.trainer is not None:
            self.trainer.kill()
        self.lock.release()

    def __enter__(self) -> "RLRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
