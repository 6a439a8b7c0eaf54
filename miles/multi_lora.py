"""Multi-LoRA RL: several LoRA adapters trained at once on one frozen base model and one engine set, by one or more
trainer groups.

Each adapter is trained by its trainer group (`trainer_group`): train.num_workers LoRATrainActors placed by Ray,
holding the frozen base (sharded with train.sharding=fsdp) and their adapters. The adapters of one group take turns
on it; groups train at the same time, and a group that dies is restarted alone (its adapters restored from their
checkpoints and ledgers) while the other groups' adapters go on. Every group's adapters are served by the one
InferenceController, which batches their requests together.

Each adapter is an AdapterRun with a run directory of its own, <run_dir>/adapters/<name>/ (rollouts, ledger, checkpoints with a
PEFT directory, metrics.jsonl), with its own data, reward, optimizer, learning rate and step budget. Its
iteration is generate -> get -> train -> push_adapter; the engines batch concurrent adapters' requests
together, and a push replaces only that adapter. An adapter that reaches its `num_steps` is saved and
retired (unloaded from the engines and the trainer) while the others go on.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
from transformers import AutoTokenizer

from miles.cluster import ActorGroup, RestartableActor, ensure_ray
from miles.config import AdapterConfig, ConfigError, RunConfig, embedded_adapters
from miles.iterations import Iterations, PolicyInputs
from miles.preflight import check_start
from miles.progress import AdapterReporter, ProgressLine
from miles.resume import ResumePlan
from miles.rollout.inference_controller import InferenceController
from miles.rollout.store import RolloutStore
from miles.run import check_context, check_inputs, initial_model, starting_tokenizer
from miles.run_dir import RunDir
from miles.train.group import start_worker_group
from miles.train.lora import LoRATrainActor

log = logging.getLogger(__name__)


def resolve_adapters(config: RunConfig) -> list[AdapterConfig]:
    """The configured adapters; on the embedded model with none configured, one per built-in task."""
    if config.adapters:
        return list(config.adapters)
    if config.model.path is None:
        return embedded_adapters()
    raise ConfigError("adapters: the multi-LoRA flow needs at least one adapter")


def check_adapter_inputs(config: RunConfig) -> dict[str, PolicyInputs]:
    """Each adapter's view of the run, dataset and reward, checked before any work; errors name the adapter."""
    checked = {}
    for index, adapter in enumerate(resolve_adapters(config)):
        if config.model.path is None and adapter.data.task is None:
            raise ConfigError(
                f"adapters.{index}.data.task: the embedded base model is built for built-in tasks; "
                f"set a task for adapter {adapter.name!r} or set model.path"
            )
        try:
            checked[adapter.name] = check_inputs(config.adapter_view(adapter))
        except ConfigError as exc:
            raise ConfigError(f"adapters.{index} ({adapter.name}): {exc}") from None
    check_start(config)
    start = starting_tokenizer(config, sorted({a.data.task for a in resolve_adapters(config) if a.data.task}))
    for index, (name, inputs) in enumerate(checked.items()):
        try:
            check_context(inputs, start)
        except ConfigError as exc:
            raise ConfigError(f"adapters.{index} ({name}): {exc}") from None
    return checked


class AdapterRun:
    """One adapter of the multi-LoRA run: the same calls as RLRun, with push_adapter for sync_weights and retire
    after its last rollout. It shares the engines with the other adapters, and its trainer group with those
    assigned to the same group."""

    def __init__(
        self,
        adapter: AdapterConfig,
        inputs: PolicyInputs,
        *,
        controller: InferenceController,
        trainer: RestartableActor,
        tokenizer,
        progress: ProgressLine,
    ):
        self.adapter = adapter
        self.name = adapter.name
        self.label = f"{adapter.name}, "
        self.config = inputs.config
        self.run_dir = RunDir(self.config.run_dir)
        self.controller = controller
        self.trainer = trainer
        self.retired = False
        self.plan = ResumePlan.read(self.run_dir, RolloutStore(self.run_dir.rollouts), self.label)
        self.iterations = Iterations(inputs, self.plan, controller, tokenizer, adapter=adapter.name)
        self.reporter = AdapterReporter(progress, adapter.name, self.config.num_rollout)
        if self.rollout_ids():
            self.restore_on(trainer.group)
            self.lora_config = trainer.call(LoRATrainActor.adapter_config, adapter.name)
            self._push(self.iterations.trainer_version)

    def restore_on(self, trainer: ActorGroup) -> None:
        """Add this adapter to every worker of `trainer` (at the start, or after a restart): its latest intact
        checkpoint, then the rollouts trained since."""

        def start(checkpoint: Path | None) -> ActorGroup:
            trainer.call(LoRATrainActor.add_adapter, self.adapter, self.config, str(checkpoint) if checkpoint else None)
            return trainer

        def train(trainer: ActorGroup, rollout_id: int, table: pa.Table) -> None:
            trainer.call(LoRATrainActor.train, self.name, rollout_id, table)

        self.iterations.restore(start, train)

    def _push(self, version: int) -> None:
        self.trainer.hand_over(
            LoRATrainActor.adapter_weights,
            self.name,
            to=lambda weights: self.controller.load_adapter(self.name, weights, self.lora_config, version),
        )

    def rollout_ids(self) -> range:
        return self.iterations.rollout_ids()

    def generate(self, rollout_id: int) -> dict[str, Any]:
        return self.iterations.generate(rollout_id)

    def get(self, rollout_id: int) -> pa.Table:
        return self.iterations.get(rollout_id)

    def train(self, rollout_id: int, table: pa.Table) -> dict[str, float]:
        return self.iterations.train(
            rollout_id, lambda: self.trainer.call(LoRATrainActor.train, self.name, rollout_id, table)
        )

    def is_last(self, rollout_id: int) -> bool:
        """The adapter's final rollout: after it the adapter retires."""
        return self.iterations.slice.ends_run(rollout_id)

    def should_push(self, rollout_id: int) -> bool:
        return self.iterations.should_sync(rollout_id)

    def push_adapter(self, rollout_id: int) -> int:
        """Load the adapter trained on `rollout_id` (the trainer's version of it) into every engine; others untouched."""
        version = self.iterations.trainer_version
        with self.iterations.timed(rollout_id, "sync"):
            self._push(version)
        return version

    def should_save(self, rollout_id: int) -> bool:
        return self.iterations.should_save(rollout_id)

    def save_checkpoint(self, rollout_id: int) -> str:
        return self.trainer.call(
            LoRATrainActor.save_checkpoint, self.name, rollout_id, self.iterations.checkpoint_state(rollout_id)
        )

    def retire(self) -> None:
        """Free the adapter's slot in the engines and the trainer (its final checkpoint is already saved)."""
        self.controller.unload_adapter(self.name)
        self.trainer.call(LoRATrainActor.remove_adapter, self.name)
        self.retired = True

    def finish_iteration(self, rollout_id: int) -> dict[str, Any]:
        """Append the iteration's record to the adapter's metrics.jsonl (once per rollout_id) and show it."""
        record = self.iterations.finish_iteration(rollout_id)
        self.reporter.update_record(record)
        return record

    def should_evaluate(self, rollout_id: int) -> bool:
        return self.iterations.should_evaluate(rollout_id)

    def evaluate(self, rollout_id: int) -> list[dict[str, Any]]:
        """Evaluate the adapter the engines hold (version rollout_id) on its eval data sets."""
        return self.iterations.evaluate(rollout_id)


class MultiLoRARun:
    """The shared pieces (run lock, base model, trainer groups, engines) and one AdapterRun per adapter."""

    def __init__(self, config: RunConfig):
        checked = check_adapter_inputs(config)
        config = config.model_copy(update={"adapters": resolve_adapters(config)})
        self.config = config
        self.run_dir = RunDir(config.run_dir).create()
        self.adapters: dict[str, AdapterRun] = {}
        with ExitStack() as started:  # an error on the way releases what was taken so far
            started.callback(self.run_dir.lock().release)
            tasks = sorted({a.data.task for a in config.adapters if a.data.task is not None})
            self.initial_model = initial_model(self.run_dir, config, tasks)
            tokenizer = AutoTokenizer.from_pretrained(self.initial_model)
            ensure_ray(config.ray_address, actors=config.ray_actors)
            self.trainer_groups: dict[str, RestartableActor] = {}
            for group in sorted({adapter.trainer_group for adapter in config.adapters}):
                self.trainer_groups[group] = RestartableActor(
                    f"LoRA trainer group {group}", partial(self._restored_trainer_group, group)
                )
                started.callback(self.trainer_groups[group].kill)
            self.controller = InferenceController(str(self.initial_model), 0, config.rollout, config.adapters)
            started.callback(self.controller.shutdown)
            progress = ProgressLine("multi-LoRA", sum(a.num_steps for a in config.adapters), echo_updates=False)
            started.callback(progress.close)
            for adapter in config.adapters:
                self.adapters[adapter.name] = AdapterRun(
                    adapter,
                    checked[adapter.name],
                    controller=self.controller,
                    trainer=self.trainer_groups[adapter.trainer_group],
                    tokenizer=tokenizer,
                    progress=progress,
                )
                started.callback(self.adapters[adapter.name].iterations.close)
            progress.update(sum(a.plan.first_rollout_id for a in self.adapters.values()))
            self._record_start()
            self._resources = started.pop_all()

    def _record_start(self) -> None:
        start = {
            "rollout_id": {name: a.plan.first_rollout_id for name, a in self.adapters.items()},
            "replayed": {name: list(a.plan.replay) for name, a in self.adapters.items()},
        }
        self.run_dir.record_start(self.config.model_dump(mode="json"), self.initial_model, start)

    def _restored_trainer_group(self, group: str) -> ActorGroup:
        """Trainer group `group` holding each of its adapters still training, restored from its checkpoint and ledger."""
        trainer = start_worker_group(self.config, LoRATrainActor, str(self.initial_model))
        for adapter in self.adapters.values():
            if adapter.adapter.trainer_group == group and adapter.rollout_ids() and not adapter.retired:
                adapter.restore_on(trainer)
        return trainer

    def active(self) -> list[AdapterRun]:
        """The adapters with rollouts left to train in this run."""
        return [a for a in self.adapters.values() if a.rollout_ids()]

    def close(self) -> None:
        self._resources.close()

    def __enter__(self) -> MultiLoRARun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
