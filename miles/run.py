"""RLRun: full-model RL on one run directory: the engines, the trainer, and the policy's iterations.

Flows and the plain loop drive the same calls: generate -> get -> train -> sync_weights per rollout_id,
then save_checkpoint when due and finish_iteration. Each call is idempotent per rollout_id. The multi-LoRA run
(miles.multi_lora.run) drives the same calls per adapter.
"""

from __future__ import annotations

import logging
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
from transformers import AutoTokenizer

from miles.cluster.actors import ActorGroup, RestartableActor, ensure_ray
from miles.cluster.memory_budget import ModelShape, resident_bytes, trainer_parts
from miles.cluster.placement import (
    ColocatedBundles,
    PlacementRecord,
    check_transport,
    location_of,
    ray_actors,
    torch_device,
    weight_transport,
)
from miles.config import ConfigChange, ConfigError, RunConfig, recorded_changes
from miles.data import check_prompt_tokens, load_rows
from miles.data.prompts import PromptFormatter
from miles.evaluation.evaluate import load_eval_sets
from miles.iterations import Iterations, PolicyInputs, PolicyRun
from miles.models import build_tokenizer, ensure_embedded_model
from miles.models.tiny import tool_tokens
from miles.observe.progress import IterationReporter
from miles.preflight import check_start, load_model_files
from miles.resume import ResumePlan
from miles.rewards import resolve_reward
from miles.rollout.generation import resolve_generate_fn
from miles.rollout.inference_controller import InferenceController
from miles.rollout.store import RolloutStore
from miles.rollout.weight_transport import (
    DiskTransport,
    DistributedTransport,
    ObjectStoreTransport,
    TensorTransport,
    TrainerWeights,
)
from miles.state.checkpoint import MODEL_DIR, latest_checkpoint, read_state
from miles.state.run_dir import Ledger, RunDir
from miles.train.actor import TrainActor
from miles.train.algorithms import Algorithm
from miles.train.critic import CriticActor
from miles.train.group import start_trainer_group, start_worker_group
from miles.weights.check import WeightProbe
from miles.weights.version import trained_version

log = logging.getLogger(__name__)


def check_inputs(config: RunConfig) -> PolicyInputs:
    """Load the datasets (training and eval), resolve the rewards, the algorithm and the engine's weight transport:
    everything that can reject the input, before any work."""
    if config.model.path is None and config.data.task is None:
        raise ConfigError("model.path: the embedded model is built for a built-in task; set data.task or model.path")
    if config.rollout.top_p < 1:
        log.warning(
            "rollout.top_p=%s: the engines sample from the top-p truncated distribution but report each token's "
            "log-prob under the whole one, as the trainer computes it; off-policy corrections (TIS) and the ratio "
            "do not see the truncation",
            config.rollout.top_p,
        )
    try:
        algorithm = Algorithm.from_config(config.algo)
        if algorithm.needs_critic:
            config.check_critic_group()
        weight_transport(config.rollout, config.train)
        resolve_generate_fn(config)
        return PolicyInputs(
            config,
            load_rows(config.data),
            resolve_reward(config.data.reward, config),
            load_eval_sets(config),
            algorithm,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class StartingTokenizer(NamedTuple):
    """The tokenizer and context length of the model a run starts from, and what to call that model in errors."""

    tokenizer: Any
    context: int
    model: str


def starting_tokenizer(config: RunConfig, tasks: list[str]) -> StartingTokenizer:
    """The starting model's tokenizer and context, without building the embedded model (its tokenizer and shape are
    known from the config)."""
    model = RunDir(config.run_dir).pinned_initial_model() or config.model.path
    if model is None:
        return StartingTokenizer(
            build_tokenizer(tool_tokens(tasks)), config.model.tiny.max_position_embeddings, "the embedded model"
        )
    tokenizer, model_config = load_model_files(str(model))
    return StartingTokenizer(tokenizer, model_config.max_position_embeddings, str(model))


def check_context(inputs: PolicyInputs, start: StartingTokenizer) -> None:
    """Every prompt, of the training data and of each eval data set, can be formatted for the model (a chat
    template where one is needed) and, with its max_new_tokens, fits the model's context (before any work starts)."""
    config = inputs.config
    checks = [(config.data, inputs.rows, config.rollout.max_new_tokens, "rollout.max_new_tokens", "")]
    for index, (dataset, rows, _) in enumerate(inputs.eval_sets):
        budget = dataset.max_new_tokens or config.rollout.max_new_tokens
        checks.append((dataset, rows, budget, "max_new_tokens", f"eval.datasets.{index} ({dataset.name}): "))
    for data, rows, max_new_tokens, budget_field, where in checks:
        prompts = PromptFormatter(start.tokenizer, data)
        try:
            prompts.check([r["prompt"] for r in rows], start.model)
            source = data.path or f"task {data.task}"
            check_prompt_tokens(rows, prompts, max_new_tokens, start.context, source, budget_field)
        except ValueError as exc:
            raise ConfigError(where + str(exc)) from None


def check_run(config: RunConfig) -> PolicyInputs:
    """Everything that can reject a full-model run before its engines and trainer start: the inputs, the start
    (miles.preflight), every prompt's fit in the starting model's context. The `miles` CLI runs it before Prefect
    starts, the run again at its start."""
    inputs = check_inputs(config)
    check_start(config)
    check_context(inputs, starting_tokenizer(config, [config.data.task]))
    return inputs


def initial_model(run_dir: RunDir, config: RunConfig, tasks: list[str]) -> Path:
    """The run's starting model: the one it has trained from (run.json), else model.path, else the embedded model for
    `tasks`."""
    pinned = run_dir.pinned_initial_model()
    if pinned is not None:
        return pinned
    if config.model.path:
        return Path(config.model.path).resolve()
    return ensure_embedded_model(config.model, tasks, config.seed)


def check_off_policy_correction(config: RunConfig) -> None:
    """Training off-policy (the async flows) needs a correction for the stale rollout log-probs."""
    if not (config.algo.use_tis or config.algo.use_rollout_logprobs):
        raise ConfigError("the async flows train off-policy: set algo.use_tis=true or algo.use_rollout_logprobs=true")


def check_fully_async(config: RunConfig) -> None:
    """The fully-async flow trains off-policy, and generates rollouts ahead of the ones it trains, one round each."""
    check_off_policy_correction(config)
    if config.algo.dynamic_sampling:
        raise ConfigError(
            "algo.dynamic_sampling: the fully-async flow generates rollouts ahead, one round of prompts each, and "
            "cannot wait for a rollout's extra rounds; use rl-async or rl-sync with dynamic sampling"
        )


class RLRun(PolicyRun):
    """Full-model RL: a trainer group (train.num_workers TrainActors), engines that take full weight pushes.

    A trainer worker that dies takes its group down; the group is started again on the next call (the task's
    retry): from the latest intact checkpoint, then re-trained on the rollouts trained since, so it holds the
    weights it had.
    """

    label = ""  # prefixes task run names in the UI; an adapter's run names its adapter

    def __init__(self, config: RunConfig):
        # Every node resolves the run directory alike, whatever its working directory.
        config = config.model_copy(update={"run_dir": str(Path(config.run_dir).resolve())})
        config = config.with_changes(recorded_changes(RunDir(config.run_dir)))
        inputs = check_run(config)
        self.algorithm = inputs.algorithm
        self.transport = weight_transport(config.rollout, config.train)
        self.config = config
        self.run_dir = RunDir(config.run_dir).create()
        with ExitStack() as started:  # an error on the way releases what was taken so far
            started.callback(self.run_dir.lock().release)
            self.initial_model = initial_model(self.run_dir, config, [config.data.task])
            tokenizer = AutoTokenizer.from_pretrained(self.initial_model)
            plan = ResumePlan.read(self.run_dir, RolloutStore(self.run_dir.rollouts))
            self._record_start(plan)
            ensure_ray(config.ray_address, actors=ray_actors(config, self.algorithm.needs_critic))
            self.colocated = ColocatedBundles(config.train.num_workers) if config.rollout.colocate else None
            if self.colocated is not None:
                started.callback(self.colocated.release)
            self.controller = self._start_engines(plan)
            started.callback(self.controller.shutdown)
            self.iterations = Iterations(inputs, plan, self.controller, tokenizer)
            started.callback(self.iterations.close)
            self.trainer = RestartableActor("trainer", self._restored_trainer)
            started.callback(self.trainer.kill)
            if self.algorithm.needs_critic:
                self.critic = RestartableActor("critic", self._restored_critic)
                started.callback(self.critic.kill)
            self.served_dtype = self.controller.engine_class.served_dtype(str(self.initial_model), config.rollout)
            self._weight_transport = self._start_transport(
                TrainerWeights(
                    self.trainer,
                    self.served_dtype,
                    version=lambda: self.iterations.trainer_version,
                    probe=self._weight_probe,
                    senders=config.train.num_workers if self.colocated is not None else 1,
                )
            )
            self._record_placement()
            if self.iterations.trainer_version == plan.saved_weight_version:  # both hold the checkpoint's weights
                self.controller.hold(self._weight_probe())
            self._push_replayed_weights(plan)
            self.reporter = IterationReporter(config.num_rollout, plan.first_rollout_id)
            started.callback(self.reporter.close)
            self._resources = started.pop_all()

    def _record_start(self, plan: ResumePlan) -> None:
        self.run_dir.record_start(
            self.config.model_dump(mode="json"),
            self.initial_model,
            {
                "rollout_id": plan.first_rollout_id,
                "checkpoint": str(plan.checkpoint) if plan.checkpoint else None,
                "replayed": list(plan.replay),
            },
        )

    def _record_placement(self) -> None:
        """Where Ray put the trainer's ranks and the engines, in run.json; a transport they cannot carry is refused."""
        groups = {"policy": self.trainer, **({"critic": self.critic} if self.algorithm.needs_critic else {})}
        record = PlacementRecord(
            colocated=self.colocated is not None,
            transport=self.transport,
            trainers={name: [location_of(handle) for handle in group.handles] for name, group in groups.items()},
            engines=self.controller.locations(),
        )
        self.run_dir.record_placement(record.record())
        check_transport(self.transport, record.trainers["policy"], record.engines, record.colocated)

    def _start_engines(self, plan: ResumePlan) -> InferenceController:
        """Engines on the checkpoint's weights (else the starting model's), at the checkpoint's weight version."""
        # Weights a previous start pushed are not this start's: a version re-trained by the replay is pushed anew.
        shutil.rmtree(self.run_dir.engine_weights, ignore_errors=True)
        model = plan.checkpoint / MODEL_DIR if plan.checkpoint else self.initial_model
        resident = None
        if self.colocated is not None:  # what each trainer rank keeps on its engine's GPU between steps
            resident = resident_bytes(trainer_parts(self.config, ModelShape.read(self.initial_model)))
        return InferenceController(
            str(model), plan.saved_weight_version, self.config.rollout, colocated=self.colocated,
            trainer_resident_bytes=resident,
        )  # fmt: skip

    def _restored_trainer(self) -> ActorGroup:
        """The trainer group from the latest intact checkpoint, re-trained on the rollouts trained after it."""

        def start(checkpoint: Path | None) -> ActorGroup:
            return start_trainer_group(self.config, self.initial_model, checkpoint, self.colocated)

        def train(trainers: ActorGroup, rollout_id: int, table: pa.Table) -> None:
            try:
                trainers.call(TrainActor.train, rollout_id, table)
            except BaseException:
                trainers.kill()  # a group that failed its replay is not handed out: release its resources
                raise

        return self.iterations.restore(start, train)

    def _restored_critic(self) -> ActorGroup:
        """The critic's group from its latest intact checkpoint (else from critic.model_path or the policy's starting
        model), re-trained on every rollout the policy has trained since that checkpoint, from their stored files and
        values: the critic comes out with the weights it had, and catches up on a rollout the policy trained before
        the critic's turn came (a run stopped between the two). At the start and after a critic worker died."""
        critic_dir = self.run_dir.critic().create()
        checkpoint = latest_checkpoint(critic_dir.checkpoints)
        saved = read_state(checkpoint)["rollout_id"] if checkpoint else -1
        ledger = critic_dir.ledger()
        ledger.forget_after(saved)
        model = self.config.critic.model_path or self.initial_model
        group = start_worker_group(
            self.config.critic_view(), CriticActor, str(model), str(checkpoint) if checkpoint else None
        )
        try:
            for rollout_id in sorted(i for i in self.run_dir.ledger().trained if i > saved):
                table, _ = self.iterations.executor.get(rollout_id, trainer_version=trained_version(rollout_id - 1))
                self._record_critic(ledger, rollout_id, group.call(CriticActor.train, rollout_id, table))
        except BaseException:
            group.kill()  # a group that failed its replay is not handed out: release its resources
            raise
        return group

    @staticmethod
    def _record_critic(ledger: Ledger, rollout_id: int, metrics: dict[str, float]) -> None:
        if rollout_id not in ledger.trained:  # a retried train_critic was answered from the critic's record
            ledger.record(rollout_id, metrics)

    def _push_replayed_weights(self, plan: ResumePlan) -> None:
        """The replayed rollouts moved the trainer past the checkpoint the engines started from."""
        if self.iterations.trainer_version != plan.saved_weight_version:
            self._push_weights(self.iterations.trainer_version)

    def _start_transport(self, source: TrainerWeights):
        """The rollout.weight_transport of the trainer's weights to this run's engines."""
        if self.transport == "distributed":
            return DistributedTransport(
                source,
                lambda: self.controller.engines,
                self.controller.ranks_per_engine,
                self.controller.engine_class.distributed_load_format,
                backend="nccl" if torch_device(self.config.rollout.device).type == "cuda" else "gloo",
                timeout_s=self.config.rollout.engine_timeout_s,
            )
        if self.transport == "disk":
            return DiskTransport(source, self.run_dir.engine_weights)
        if self.transport == "tensor":
            return TensorTransport(source)
        return ObjectStoreTransport(source)

    def _push_weights(self, version: int) -> None:
        """Full weights as `version` to every engine, by rollout.weight_transport; a version they hold is skipped."""
        if not self.controller.serves(version):
            self.controller.update_weights(self._weight_transport.push(version))

    def _weight_probe(self) -> WeightProbe:
        return self.trainer.call(TrainActor.weight_probe, self.served_dtype)

    def change_config(self, change: ConfigChange) -> None:
        """Apply `change` from its rollout on (one not yet generated), and record it in run.json for every later start."""
        config = self.config.with_changes([change])
        config.at(change.rollout_id)  # refuses values that do not validate, before anything changes
        if config.final.num_rollout < change.rollout_id:
            raise ConfigError(
                f"num_rollout: {config.final.num_rollout} ends the run before rollouts it has trained "
                f"(the next is {change.rollout_id})"
            )
        self.trainer.call(TrainActor.change_config, config)
        if self.algorithm.needs_critic:
            self.critic.call(CriticActor.change_config, config.critic_view())
        self.config = config
        self.iterations.change_config(config)
        self.run_dir.record_change(change.model_dump(mode="json"))

    def release(self) -> None:
        """Stop the engines and the trainer group, keeping the run: `start_again` brings them back."""
        self.controller.shutdown()
        self.trainer.release()
        if self.algorithm.needs_critic:
            self.critic.release()

    def start_again(self) -> None:
        """After `release`, at a boundary where the trained weights are saved: the engines start on them; the trainer
        group starts on its next call, from the run directory."""
        version = self.iterations.trainer_version
        self.controller.start_again(str(self.run_dir.checkpoint(version - 1) / MODEL_DIR), version)

    def train(self, rollout_id: int, table: pa.Table) -> dict[str, float]:
        return self.iterations.train(rollout_id, lambda: self.trainer.call(TrainActor.train, rollout_id, table))

    def compute_values(self, rollout_id: int) -> None:
        """The critic's values of the stored rollout's tokens, stored beside it (values_<id>.arrow) before `get`
        estimates its advantages; a rollout whose values are stored keeps them (a retry, a resumed run)."""
        store = self.iterations.store
        if store.read_values(rollout_id) is not None:
            return
        table = store.read(rollout_id)
        with self.iterations.timed(rollout_id, "values"):
            values = self.critic.call(CriticActor.values, table)
        store.write_values(rollout_id, table.column("sample_index").to_pylist(), values)

    def train_critic(self, rollout_id: int, table: pa.Table) -> dict[str, float]:
        """The critic's optimizer steps on the rollout's returns, recorded in the critic's ledger (once per rollout)."""
        with self.iterations.timed(rollout_id, "critic"):
            metrics = self.critic.call(CriticActor.train, rollout_id, table)
        self._record_critic(self.run_dir.critic().ledger(), rollout_id, metrics)
        self.iterations.add_metrics(rollout_id, metrics)
        return metrics

    def release_engine_memory(self, rollout_id: int) -> None:
        """Colocated, before training on `rollout_id` with no generation until its push: the engines give their
        memory to the trainer beside them (their weights too when a push follows this rollout)."""
        self.controller.release_memory(weights=self.should_sync(rollout_id))

    def sync_weights(self, rollout_id: int) -> int:
        """Push the weights trained on `rollout_id` (the trainer's version) to every engine."""
        return self.push_trained(rollout_id, self._push_weights)

    def save_checkpoint(self, rollout_id: int) -> str:
        """The policy's checkpoint of `rollout_id`, and the critic's (first, in its own directory) with one."""
        if self.algorithm.needs_critic:
            self.critic.call(CriticActor.save_checkpoint, rollout_id, {"seed": self.config.seed})
        return self.trainer.call(TrainActor.save_checkpoint, rollout_id, self.iterations.checkpoint_state(rollout_id))

    def close(self) -> None:
        self._resources.close()

    def __enter__(self) -> RLRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
