"""Multi-LoRA RL: several LoRA adapters trained at once on one frozen base model, one engine set, one trainer.

Each adapter is a PolicyRun of its own in <run_dir>/adapters/<name>/ (rollouts, ledger, checkpoints with a
PEFT directory, metrics.jsonl), with its own data, reward, optimizer, learning rate and step budget. Its
iteration is generate -> get -> train -> push_adapter; the engines batch concurrent adapters' requests
together, and a push replaces only that adapter. An adapter that reaches its `num_steps` is saved and
retired (unloaded from the engines and the trainer) while the others go on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pyarrow as pa
import ray
from transformers import AutoTokenizer

from miles.checkpoint import ADAPTER_DIR, RunLock, checkpoint_dir, latest_checkpoint
from miles.cluster import RestartableActor, actor_options, ensure_ray
from miles.config import AdapterConfig, ConfigError, RunConfig, embedded_adapters
from miles.evaluate import evaluate_checkpoint
from miles.progress import AdapterReporter, ProgressLine
from miles.rewards import RewardFn
from miles.rollout.inference_controller import InferenceController
from miles.run import PolicyRun, check_context, check_inputs, initial_model, write_run_record
from miles.train.lora import LoRATrainActor

log = logging.getLogger(__name__)


def resolve_adapters(config: RunConfig) -> list[AdapterConfig]:
    """The configured adapters; on the embedded model with none configured, one per built-in task."""
    if config.adapters:
        return list(config.adapters)
    if config.model.path is None:
        return embedded_adapters()
    raise ConfigError("adapters: the multi-LoRA flow needs at least one adapter")


def check_adapter_inputs(config: RunConfig) -> dict[str, tuple[RunConfig, list[dict[str, str]], RewardFn]]:
    """Each adapter's view of the run, dataset and reward, checked before any work; errors name the adapter."""
    checked = {}
    for index, adapter in enumerate(resolve_adapters(config)):
        if config.model.path is None and adapter.data.task is None:
            raise ConfigError(f"adapters.{index}.data.task: the embedded base model is built for built-in tasks; "
                              f"set a task for adapter {adapter.name!r} or set model.path")
        view = config.adapter_view(adapter)
        try:
            rows, reward_fn = check_inputs(view)
        except ConfigError as exc:
            raise ConfigError(f"adapters.{index} ({adapter.name}): {exc}") from None
        checked[adapter.name] = (view, rows, reward_fn)
    return checked


class AdapterRun(PolicyRun):
    """One adapter's branch of the multi-LoRA run; the same calls as RLRun, with push_adapter for sync_weights."""

    def __init__(self, adapter: AdapterConfig, view: RunConfig, base: MultiLoRARun, rows, reward_fn: RewardFn):
        self.adapter = adapter
        self.name = adapter.name
        self.label = f"{adapter.name}, "
        self.base = base
        self.controller = base.controller
        self.initial_model = base.initial_model
        self.retired = False
        self._resume(view)
        self._start_rollouts(base.controller, base.tokenizer, rows, reward_fn, adapter=adapter.name)
        self.reporter = AdapterReporter(base.progress, adapter.name, view.num_rollout)
        if self.rollout_ids():
            self.restore_on(base.trainer.handle)
            self._finish_replayed()
            self.lora_config = self.base.trainer.call("adapter_config", adapter.name)
            self._push(self.trainer_version)

    def restore_on(self, trainer: ray.actor.ActorHandle) -> None:
        """Add this adapter to `trainer` (at the start, or after a restart): its latest intact checkpoint, then the
        rollouts trained since."""
        checkpoint = latest_checkpoint(self.run_dir)
        replay = self._take_replay(checkpoint)
        ray.get(trainer.add_adapter.remote(self.adapter, self.config, str(checkpoint) if checkpoint else None))
        self._replay(lambda rollout_id, table: ray.get(trainer.train.remote(self.name, rollout_id, table)), replay)

    def _train(self, rollout_id: int, table: pa.Table) -> dict[str, float]:
        return self.base.trainer.call("train", self.name, rollout_id, table)

    def _push(self, version: int) -> None:
        self.base.trainer.hand_over(
            "adapter_weights", self.name, to=lambda weights: self.controller.load_adapter(self.name, weights, self.lora_config, version)
        )

    def is_last(self, rollout_id: int) -> bool:
        """The adapter's final rollout: after it the adapter retires instead of being pushed."""
        return rollout_id == self.config.num_rollout - 1

    def push_adapter(self, rollout_id: int) -> int:
        """Load the adapter trained on `rollout_id` into every engine as version rollout_id + 1; others untouched."""
        started = time.perf_counter()
        version = rollout_id + 1
        self._push(version)
        self._timed(rollout_id, "sync", started)
        return version

    def save_checkpoint(self, rollout_id: int) -> str:
        return self.base.trainer.call("save_checkpoint", self.name, rollout_id, self._checkpoint_state(rollout_id))

    def retire(self) -> None:
        """Free the adapter's slot in the engines and the trainer (its final checkpoint is already saved)."""
        self.controller.unload_adapter(self.name)
        self.base.trainer.call("remove_adapter", self.name)
        self.retired = True

    def evaluate(self, rollout_id: int, prompts: int = 200) -> dict[str, float]:
        """Greedy accuracy (transformers + peft) of the base model and of the base with checkpoint `rollout_id`."""
        task = self.config.data.task
        if task is None:
            return {}
        adapter_dir = checkpoint_dir(self.run_dir, rollout_id) / ADAPTER_DIR
        return {
            "greedy_accuracy_initial": evaluate_checkpoint(self.initial_model, task, prompts),
            "greedy_accuracy_final": evaluate_checkpoint(self.initial_model, task, prompts, adapter_dir=adapter_dir),
        }


class MultiLoRARun:
    """The shared pieces (run lock, base model, trainer, engines) and one AdapterRun per adapter."""

    def __init__(self, config: RunConfig):
        checked = check_adapter_inputs(config)
        config = config.model_copy(update={"adapters": resolve_adapters(config)})
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.lock = RunLock(self.run_dir)
        self.trainer = self.controller = self.progress = None
        try:
            tasks = sorted({a.data.task for a in config.adapters if a.data.task is not None})
            self.initial_model = initial_model(self.run_dir, config, tasks)
            self.tokenizer = AutoTokenizer.from_pretrained(self.initial_model)
            for index, (name, (view, rows, _)) in enumerate(checked.items()):
                try:
                    check_context(view, rows, self.tokenizer, self.initial_model)
                except ConfigError as exc:
                    raise ConfigError(f"adapters.{index} ({name}): {exc}") from None
            ensure_ray(config.ray_address, actors=config.ray_actors)
            self.adapters: dict[str, AdapterRun] = {}
            self.trainer = RestartableActor("LoRA trainer", self._start_trainer)
            self.controller = InferenceController(str(self.initial_model), 0, config.rollout, config.adapters)
            total = sum(a.num_steps for a in config.adapters)
            self.progress = ProgressLine("multi-LoRA", total, echo_updates=False)
            for adapter in config.adapters:
                view, rows, reward_fn = checked[adapter.name]
                self.adapters[adapter.name] = AdapterRun(adapter, view, self, rows, reward_fn)
            self.progress.update(sum(a.start_rollout_id for a in self.adapters.values()))
            write_run_record(self.run_dir, config, self.initial_model,
                             {"rollout_id": {name: a.start_rollout_id for name, a in self.adapters.items()},
                              "replayed": {name: a.replayed_at_start for name, a in self.adapters.items()}})
        except BaseException:
            self.close()
            raise

    def _start_trainer(self) -> ray.actor.ActorHandle:
        """A LoRA trainer holding every adapter still training, each restored from its checkpoint and ledger."""
        trainer = ray.remote(LoRATrainActor).options(**actor_options(self.config.train.device)).remote(
            self.config, str(self.initial_model), self.config.train.device
        )
        for branch in self.adapters.values():
            if branch.rollout_ids() and not branch.retired:
                branch.restore_on(trainer)
        return trainer

    def active(self) -> list[AdapterRun]:
        """The adapters with rollouts left to train in this run."""
        return [a for a in self.adapters.values() if a.rollout_ids()]

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.controller is not None:
            self.controller.shutdown()
        if self.trainer is not None:
            self.trainer.kill()
        self.lock.release()

    def __enter__(self) -> "MultiLoRARun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
