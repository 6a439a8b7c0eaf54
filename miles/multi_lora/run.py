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
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import pyarrow as pa
from transformers import AutoTokenizer

from miles.cluster.actors import ActorGroup, RestartableActor, actor_error, ensure_ray, first_line
from miles.cluster.placement import ray_actors
from miles.config import AdapterConfig, ConfigError, RunConfig
from miles.iterations import Iterations, PolicyInputs, PolicyRun
from miles.multi_lora.inputs import (
    base_tasks,
    base_tokenizer,
    check_adapter,
    check_adapter_inputs,
    naming,
    resolve_adapters,
)
from miles.multi_lora.tenants import TenantBook
from miles.observe.progress import AdapterReporter, ProgressLine
from miles.resume import ResumePlan
from miles.rollout.inference_controller import InferenceController
from miles.rollout.store import RolloutStore
from miles.run import check_context, initial_model
from miles.state.run_dir import RunDir
from miles.train.group import start_worker_group
from miles.train.lora import LoRATrainActor

log = logging.getLogger(__name__)

TENANT_POLL_S = 1.0  # how often a run with nothing to train looks for new tenants


class AdaptersFailed(RuntimeError):
    """Adapters whose branch failed (recorded in <run_dir>/tenants/); the others went on to their end."""


class AdapterRun(PolicyRun):
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

    def train(self, rollout_id: int, table: pa.Table) -> dict[str, float]:
        return self.iterations.train(
            rollout_id, lambda: self.trainer.call(LoRATrainActor.train, self.name, rollout_id, table)
        )

    def is_last(self, rollout_id: int) -> bool:
        """The adapter's final rollout: after it the adapter retires."""
        return self.iterations.slice.ends_run(rollout_id)

    def push_adapter(self, rollout_id: int) -> int:
        """Load the adapter trained on `rollout_id` (the trainer's version of it) into every engine; others untouched."""
        return self.push_trained(rollout_id, self._push)

    def save_checkpoint(self, rollout_id: int) -> str:
        return self.trainer.call(
            LoRATrainActor.save_checkpoint, self.name, rollout_id, self.iterations.checkpoint_state(rollout_id)
        )

    def retire(self) -> None:
        """Free the adapter's slot in the engines and the trainer (its final checkpoint is already saved)."""
        self.controller.unload_adapter(self.name)
        self.trainer.call(LoRATrainActor.remove_adapter, self.name)
        self.retired = True


class MultiLoRARun:
    """The shared pieces (run lock, base model, trainer groups, engines) and one AdapterRun per adapter: the configured
    ones, and the tenants submitted to the run directory (miles.multi_lora.tenants), admitted at the start and at each iteration
    boundary (`admit`). A withdrawn or failed adapter is not resumed."""

    def __init__(self, config: RunConfig):
        checked = check_adapter_inputs(config)
        config = config.model_copy(update={"adapters": resolve_adapters(config)})
        self.config = config
        self.run_dir = RunDir(config.run_dir).create()
        self.book = TenantBook(self.run_dir)
        self.adapters: dict[str, AdapterRun] = {}
        self.failures: dict[str, str] = {}
        self.trainer_groups: dict[str, RestartableActor] = {}
        self._resources = ExitStack()
        try:
            self._start(checked)
        except BaseException:  # an error on the way releases what was taken so far
            self._resources.close()
            raise

    def _start(self, checked: dict[str, PolicyInputs]) -> None:
        config = self.config
        self._resources.callback(self.run_dir.lock().release)
        self.initial_model = initial_model(self.run_dir, config, base_tasks(config))
        self.tokenizer = AutoTokenizer.from_pretrained(self.initial_model)
        self.start_tokenizer = base_tokenizer(config)
        tenants = self.book.submitted()
        ensure_ray(
            config.ray_address,
            actors=ray_actors(config.model_copy(update={"adapters": config.adapters + tenants}), critic=False),
        )
        self.controller = InferenceController(str(self.initial_model), 0, config.rollout, config.adapters + tenants)
        self._resources.callback(self.controller.shutdown)
        self.progress = ProgressLine("multi-LoRA", 0, echo_updates=False)
        self._resources.callback(self.progress.close)
        ended = self.book.withdrawn().keys() | self.book.failed().keys()
        for adapter in config.adapters:
            if adapter.name not in ended:
                self._add(adapter, checked[adapter.name])
        self.admit()
        self._record_start()

    def _add(self, adapter: AdapterConfig, inputs: PolicyInputs) -> AdapterRun:
        """The adapter's AdapterRun, on its trainer group (started now if it is the group's first adapter)."""
        group = adapter.trainer_group
        if group not in self.trainer_groups:
            self.trainer_groups[group] = RestartableActor(
                f"LoRA trainer group {group}", partial(self._restored_trainer_group, group)
            )
            self._resources.callback(self.trainer_groups[group].kill)
        run = AdapterRun(
            adapter,
            inputs,
            controller=self.controller,
            trainer=self.trainer_groups[group],
            tokenizer=self.tokenizer,
            progress=self.progress,
        )
        self._resources.callback(run.iterations.close)
        self.adapters[adapter.name] = run
        self.progress.extend(len(run.rollout_ids()))
        return run

    def admit(self) -> list[AdapterRun]:
        """The tenants submitted since the last look, each checked again (a tenant that no longer passes is recorded
        as failed) and added; those with rollouts to train."""
        ended = self.book.withdrawn().keys() | self.book.failed().keys()
        admitted = []
        for tenant in self.book.submitted():
            if tenant.name in self.adapters or tenant.name in ended:
                continue
            where = f"tenant {tenant.name}"
            try:
                config = self.config.model_copy(update={"adapters": [*self.config.adapters, tenant]})
                inputs = check_adapter(config, tenant, where)
                with naming(where, tenant):
                    check_context(inputs, self.start_tokenizer)
            except ConfigError as exc:
                self.book.fail(tenant.name, str(exc))
                log.error("%s", exc)
                continue
            log.info("tenant %s admitted", tenant.name)
            admitted.append(self._add(tenant, inputs))
        return [run for run in admitted if run.rollout_ids()]

    def wait_for_tenants(self, until: Callable[[], bool]) -> list[AdapterRun]:
        """With nothing left to train: the tenants submitted within tenants.idle_timeout_s (unset: however long it
        takes), as soon as there are any; none when the time is up, or as soon as `until()` (the user asks for the
        run)."""
        timeout = self.config.tenants.idle_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            admitted = self.admit()
            if admitted or until() or (deadline is not None and time.monotonic() >= deadline):
                return admitted
            time.sleep(TENANT_POLL_S)

    def withdrawn(self, adapter: AdapterRun) -> bool:
        return adapter.name in self.book.withdrawn()

    def fail(self, adapter: AdapterRun, error: BaseException) -> None:
        """Record that the adapter's branch failed, in the run directory (a restart does not resume it) and here."""
        message = f"{type(actor_error(error)).__name__}: {first_line(error)}"
        self.book.fail(adapter.name, message)
        self.failures[adapter.name] = message
        log.error("adapter %s failed, the others go on: %s", adapter.name, message)

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

    def release_idle_groups(self) -> None:
        """Stop each trainer group none of whose adapters trains any more (retired, withdrawn or failed): a service's
        tenants come and go, and a group holds its workers' memory and placement. A tenant that names the group
        again starts it anew."""
        training = {
            a.adapter.trainer_group
            for a in self.adapters.values()
            if a.rollout_ids() and not a.retired and a.name not in self.failures
        }
        for group in [g for g in self.trainer_groups if g not in training]:
            log.info("trainer group %s has no adapter left to train: stopped", group)
            self.trainer_groups.pop(group).kill()

    def release(self) -> None:
        """Stop the engines and every trainer group, keeping the run: `start_again` brings them back."""
        self.controller.shutdown()
        for group in self.trainer_groups.values():
            group.release()

    def start_again(self) -> None:
        """After `release`, at a boundary where every adapter is saved: the engines start on the base, serving each
        adapter as it was last pushed; each trainer group starts on its next call, from its adapters' checkpoints."""
        self.controller.start_again(str(self.initial_model), 0)

    def check_failures(self) -> None:
        """Raise AdaptersFailed when an adapter's branch failed in this run."""
        if self.failures:
            raise AdaptersFailed(
                "; ".join(f"adapter {name} failed: {error}" for name, error in self.failures.items())
                + f" (recorded in {self.book.path}; the other adapters went on)"
            )

    def close(self) -> None:
        self._resources.close()

    def __enter__(self) -> MultiLoRARun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
