"""Iterations: one policy's rollouts in a run (the full model, or one adapter of the multi-LoRA run).

Which rollout_ids this run trains and what is due after each (`Slice`: the sync, checkpoint and evaluation rules),
`generate` and `get` through the policy's RolloutExecutor, each phase timed, the ledger (its one writer), one
metrics.jsonl line per finished iteration and per evaluation, the driver's record of the trainer's weight version,
and the restore of a trainer from the run directory. RLRun and each AdapterRun hold one; how the policy trains and
reaches the engines is theirs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import pyarrow as pa

from miles.config import RunConfig
from miles.data import DataSource
from miles.evaluation.checkpoint_eval import checkpoint_evaluations
from miles.evaluation.evaluate import EvalSet, Evaluation
from miles.lineage import code_version, rollout_lineage
from miles.observe.plots import plot_eval_curve, plot_reward_curve
from miles.observe.trackers import Trackers
from miles.resume import ResumePlan
from miles.rewards import RewardFn, close_rewards
from miles.rollout.inference_controller import InferenceController
from miles.rollout.rollout_executor import RolloutExecutor, summarize
from miles.rollout.schema import rollout_metadata
from miles.rollout.store import RolloutStore
from miles.state.run_dir import RunDir, is_evaluation
from miles.train.algorithms import Algorithm
from miles.weights.version import trained_version

log = logging.getLogger(__name__)

Trainer = TypeVar("Trainer")
PHASES = ("generate", "get", "train", "sync")


class PolicyInputs(NamedTuple):
    """A policy's checked inputs: its view of the run config, its prompt rows, its reward function, its eval sets."""

    config: RunConfig
    rows: list[dict[str, str]]
    reward: RewardFn | object  # a reward function or a batched reward (miles.rewards)
    eval_sets: list[EvalSet]
    algorithm: Algorithm


@dataclass(frozen=True)
class Slice:
    """The rollouts one start of a run trains, and what is due after each: the one place that decides the end of a
    slice (`iterations_per_run` rollouts) and of the run (`num_rollout`, as the config's changes leave it).

    The engines get the weights trained on a rollout every `update_weights_interval` rollouts, and after the slice's
    last rollout exactly when the slice's closing evaluation reads them (otherwise the next start loads its engines
    from the checkpoint, and a retiring adapter leaves them). A checkpoint is saved every `save_interval` rollouts (the
    interval in effect at that rollout) and after the slice's last rollout, where the next start resumes."""

    config: RunConfig
    first_rollout_id: int

    @property
    def rollout_ids(self) -> range:
        num_rollout = self.config.final.num_rollout
        per_run = self.config.iterations_per_run or num_rollout
        return range(self.first_rollout_id, min(num_rollout, self.first_rollout_id + per_run))

    def is_last(self, rollout_id: int) -> bool:
        """The slice's last rollout (the run's last, when the slice reaches num_rollout)."""
        return rollout_id == self.rollout_ids.stop - 1

    def ends_run(self, rollout_id: int) -> bool:
        return rollout_id == self.config.final.num_rollout - 1

    def sync_due(self, rollout_id: int, closing_evaluation_due: bool) -> bool:
        if self.is_last(rollout_id):
            return closing_evaluation_due
        return trained_version(rollout_id) % self.config.update_weights_interval == 0

    def save_due(self, rollout_id: int) -> bool:
        interval = self.config.at(rollout_id).save_interval
        return trained_version(rollout_id) % interval == 0 or self.is_last(rollout_id)


class Iterations:
    def __init__(
        self,
        inputs: PolicyInputs,
        plan: ResumePlan,
        controller: InferenceController,
        tokenizer,
        adapter: str | None = None,
    ):
        self.config = inputs.config
        self.run_dir = RunDir(self.config.run_dir)
        self.plan = plan
        self.adapter = adapter
        self.label = f"{adapter}, " if adapter else ""
        self.store = RolloutStore(self.run_dir.rollouts)
        self.data_source = DataSource(inputs.rows, seed=self.config.seed, shuffle=self.config.data.shuffle)
        if plan.data_state:
            self.data_source.load_state_dict(plan.data_state)
        self.executor = RolloutExecutor(
            self.config, controller, tokenizer, self.data_source, self.store, inputs.reward, adapter
        )
        self.slice = Slice(self.config, plan.first_rollout_id)
        self.ledger = self.run_dir.ledger()
        self.trainer_version = plan.trainer_version  # the driver's record of the weights the trainer holds
        kept = self.run_dir.keep_metrics_before(plan.first_rollout_id)
        self._recorded_ids = {r["rollout_id"] for r in kept if not is_evaluation(r)}
        self._evaluations = {(r["rollout_id"], r["eval"]): r for r in kept if is_evaluation(r)}
        self.evaluation = Evaluation(self.config, inputs.eval_sets, controller, tokenizer, adapter)
        self.trackers = Trackers(
            self.config.logging.trackers,
            self.run_dir,
            self.config.model_dump(mode="json"),
            self.config.logging.project,
            name=adapter or self.run_dir.path.name,
        )
        self._timings: dict[int, dict[str, float]] = {}
        self._summaries: dict[int, dict[str, Any]] = {}
        self._metrics: dict[int, dict[str, float]] = {}
        self._account_for_replay()

    def _account_for_replay(self) -> None:
        """The rollouts the plan replays are trained already: the data cursor goes past them, and one whose
        metrics line was never written (the process died after training it) gets it from the ledger."""
        trained = self.ledger.trained
        for rollout_id in self.plan.replay:
            table = self.store.read(rollout_id)
            self.data_source.position = int(rollout_metadata(table)["data_position_end"])
            self.executor.prompt_order.ends_at(rollout_id, self.data_source.position)
            if rollout_id not in self._recorded_ids:
                self._summaries[rollout_id] = summarize(table)
                self._metrics[rollout_id] = trained[rollout_id]
                self._append_metrics(self._iteration_record(rollout_id))
        self.executor.prompt_order.ends_at(self.plan.first_rollout_id - 1, self.data_source.position)

    def restore(
        self, start: Callable[[Path | None], Trainer], train: Callable[[Trainer, int, pa.Table], Any]
    ) -> Trainer:
        """`start(checkpoint)` with the latest intact checkpoint, then `train(trainer, rollout_id, table)` on each
        rollout trained after it, from its stored file and handed over at trainer version rollout_id as when first
        trained: the trainer comes out with the weights it had. Used at the start and after a trainer died.

        The ledger forgets those rollouts first, and records each again as the trainer re-trains it."""
        plan = ResumePlan.read(self.run_dir, self.store, self.label)
        self.ledger.forget_after(plan.saved_rollout_id)
        trainer = start(plan.checkpoint)
        for rollout_id in plan.replay:
            table, _ = self.executor.get(rollout_id, trainer_version=trained_version(rollout_id - 1))
            self._record_trained(rollout_id, train(trainer, rollout_id, table))
        if plan.replay:
            log.warning(
                "%sre-trained rollouts %s from their stored files onto the latest checkpoint",
                self.label,
                list(plan.replay),
            )
        return trainer

    def change_config(self, config: RunConfig) -> None:
        """Go on with `config`: this run's config with changes added to its schedule, none before the next rollout."""
        self.config = self.executor.config = config
        self.slice = Slice(config, self.slice.first_rollout_id)

    def rollout_ids(self) -> range:
        """The rollouts this run trains: up to num_rollout, at most iterations_per_run of them."""
        return self.slice.rollout_ids

    def should_sync(self, rollout_id: int) -> bool:
        return self.slice.sync_due(rollout_id, self.should_evaluate(rollout_id + 1))

    def should_save(self, rollout_id: int) -> bool:
        return self.slice.save_due(rollout_id)

    def checkpoint_state(self, rollout_id: int) -> dict[str, Any]:
        state = {
            "weight_version": trained_version(rollout_id),
            "data": self.data_source.state_dict(),
            "seed": self.config.seed,
        }
        if self.config.logging.lineage:
            state["lineage"] = self._lineage(rollout_id)
        return state

    def _lineage(self, rollout_id: int) -> dict[str, Any]:
        """What made the weights trained on `rollout_id` since the previous checkpoint (miles.lineage)."""
        previous = max((i for i in self.run_dir.saved_checkpoints() if i < rollout_id), default=None)
        order = self.executor.prompt_order
        rollouts = []
        for i in range(0 if previous is None else previous + 1, rollout_id + 1):
            start, end = order.start_of(i), order.end_of(i)
            rows = [(index, self.data_source.rows[index]) for index in self.data_source.indices_at(start, end - start)]
            rollouts.append(rollout_lineage(self.store.path(i), i, (start, end), rows))
        return {
            "rollout_id": rollout_id,
            "previous_checkpoint": previous,
            "rollouts": rollouts,
            "config": self.config.at(rollout_id).model_dump(mode="json"),
            "code": code_version(),
        }

    @contextmanager
    def timed(self, rollout_id: int, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self._timings.setdefault(rollout_id, {})[f"time_{phase}"] = time.perf_counter() - started

    def generate(self, rollout_id: int) -> dict[str, Any]:
        with self.timed(rollout_id, "generate"):
            summary = self.executor.generate(rollout_id)
        self._summaries.setdefault(rollout_id, {}).update(summary)
        return summary

    def get(self, rollout_id: int) -> pa.Table:
        with self.timed(rollout_id, "get"):
            table, stats = self.executor.get(rollout_id, self.trainer_version)
        self._summaries.setdefault(rollout_id, {}).update(stats)
        return table

    def train(self, rollout_id: int, train: Callable[[], dict[str, float]]) -> dict[str, float]:
        """`train()` steps the policy on rollout `rollout_id`; its metrics go into the ledger and the iteration's record."""
        with self.timed(rollout_id, "train"):
            metrics = train()
        self._record_trained(rollout_id, metrics)
        self._metrics[rollout_id] = metrics
        self.data_source.position = self.executor.prompt_order.end_of(rollout_id)  # what a checkpoint now saves
        return metrics

    def add_metrics(self, rollout_id: int, metrics: dict[str, float]) -> None:
        """Metrics of the iteration measured beside the policy's training (the critic's), for its record."""
        self._metrics.setdefault(rollout_id, {}).update(metrics)

    def _record_trained(self, rollout_id: int, metrics: dict[str, float]) -> None:
        if rollout_id not in self.ledger.trained:  # a retried train_step was answered from the trainer's record
            self.ledger.record(rollout_id, metrics)
        self.trainer_version = trained_version(rollout_id)

    def finish_iteration(self, rollout_id: int) -> dict[str, Any]:
        """The iteration's record, appended to metrics.jsonl once per rollout_id."""
        record = self._iteration_record(rollout_id)
        self._append_metrics(record)
        self._log_checkpoint_evaluations()
        return record

    def _log_checkpoint_evaluations(self) -> None:
        """Evaluations of the run's checkpoints made beside it (rl-eval, miles.evaluation.checkpoint_eval) go to its trackers, as
        the series `eval/<data set>@checkpoint/...` (a step is logged once)."""
        if self.trackers.trackers:
            for record in checkpoint_evaluations(self.run_dir):
                self.trackers.log({**record, "eval": f"{record['eval']}@checkpoint"})

    def _iteration_record(self, rollout_id: int) -> dict[str, Any]:
        record: dict[str, Any] = {"rollout_id": rollout_id}
        if self.adapter:
            record["adapter"] = self.adapter
        record["lr"] = self.config.at(rollout_id).train.lr
        changed = {f: v for c in self.config.changes if c.rollout_id == rollout_id for f, v in c.values.items()}
        if changed:
            record["config_change"] = changed
        record["finished_at"] = time.time()
        record.update(self._summaries.pop(rollout_id, {}))
        record.update(self._metrics.pop(rollout_id, {}))
        record.update({f"time_{phase}": 0.0 for phase in PHASES})
        record.update(self._timings.pop(rollout_id, {}))
        return record

    def should_evaluate(self, rollout_id: int) -> bool:
        """An evaluation is due at `rollout_id` (before this run trains it, or at the run's end) and not yet done."""
        ids = self.rollout_ids()
        return (
            ids.start <= rollout_id <= ids.stop
            and self.config.at(rollout_id).should_evaluate(rollout_id)
            and any((rollout_id, s.dataset.name) not in self._evaluations for s in self.evaluation.sets)
        )

    def evaluate(self, rollout_id: int) -> list[dict[str, Any]]:
        """One record per eval data set, evaluated on the engines' current weights; a data set already evaluated at
        `rollout_id` (a retry, a resumed run) returns its record without running again."""
        records = []
        for eval_set in self.evaluation.sets:
            key = (rollout_id, eval_set.dataset.name)
            if key not in self._evaluations:
                self._evaluations[key] = record = self.evaluation.run(eval_set, rollout_id)
                self._append_metrics(record)
                log.info(
                    "%seval %s at rollout %d: %s",
                    self.label,
                    key[1],
                    rollout_id,
                    "  ".join(f"{k} {v:.3f}" for k, v in record.items() if k == "reward_mean" or k.startswith("pass_")),
                )
            records.append(self._evaluations[key])
        return records

    def _append_metrics(self, record: dict[str, Any]) -> None:
        if is_evaluation(record) or record["rollout_id"] not in self._recorded_ids:
            self.run_dir.append_metrics(record)
            if not is_evaluation(record):
                self._recorded_ids.add(record["rollout_id"])
        self.trackers.log(record)  # after metrics.jsonl, which a resumed run catches the trackers up from

    def plot_curves(self) -> dict[str, Path]:
        """reward_curve.png and eval_<name>.png per eval data set, from metrics.jsonl (the whole run, every start),
        also sent to the trackers; keyed by their name in the trackers."""
        records = self.run_dir.records()
        iterations = [r for r in records if not is_evaluation(r)]
        name = self.run_dir.path.name
        curves = {"reward_curve": plot_reward_curve(iterations, name, self.run_dir.reward_curve_path)}
        for dataset in dict.fromkeys(r["eval"] for r in records if is_evaluation(r)):
            evaluations = [r for r in records if r.get("eval") == dataset]
            title = f"{name}: eval {dataset}"
            curves[f"eval/{dataset}"] = plot_eval_curve(evaluations, title, self.run_dir.eval_curve_path(dataset))
        step = max((r["rollout_id"] for r in records), default=0)
        for key, png in curves.items():
            self.trackers.log_image(key, png, step)
        return curves

    def close(self) -> None:
        """Close the trackers, and stop what the rewards started (a judge's engines, a reward model's actor)."""
        self.trackers.close()
        close_rewards(self.executor.client.scorer.reward, *(s.reward for s in self.evaluation.sets))


class PolicyRun:
    """What a run that trains one policy (RLRun, AdapterRun) hands on to its Iterations, written once: the schedules
    ask these of either."""

    iterations: Iterations
    reporter: Any  # shows each finished iteration (miles.observe.progress)

    def rollout_ids(self) -> range:
        return self.iterations.rollout_ids()

    def generate(self, rollout_id: int) -> dict[str, Any]:
        return self.iterations.generate(rollout_id)

    def get(self, rollout_id: int) -> pa.Table:
        return self.iterations.get(rollout_id)

    def should_sync(self, rollout_id: int) -> bool:
        return self.iterations.should_sync(rollout_id)

    def should_save(self, rollout_id: int) -> bool:
        return self.iterations.should_save(rollout_id)

    def should_evaluate(self, rollout_id: int) -> bool:
        return self.iterations.should_evaluate(rollout_id)

    def evaluate(self, rollout_id: int) -> list[dict[str, Any]]:
        """Evaluate the weights the engines hold (version rollout_id, once its push is done) on the policy's eval
        data sets."""
        return self.iterations.evaluate(rollout_id)

    def push_trained(self, rollout_id: int, push: Callable[[int], None]) -> int:
        """Push the trainer's version (the weights trained on `rollout_id`) with `push`, timed as the iteration's sync;
        returns that version."""
        version = self.iterations.trainer_version
        with self.iterations.timed(rollout_id, "sync"):
            push(version)
        return version

    def finish_iteration(self, rollout_id: int) -> dict[str, Any]:
        """Append the iteration's record to the policy's metrics.jsonl (once per rollout_id) and show it."""
        record = self.iterations.finish_iteration(rollout_id)
        self.reporter.update_record(record)
        return record
