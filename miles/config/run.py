"""The whole run's config: its own settings, the sections, the presets a field left unset takes, the schedule of
changes, and the views a trainer group or an adapter takes of it."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from miles.config.adapters import AdapterConfig, TenantsConfig
from miles.config.algo import AlgoConfig
from miles.config.base import (
    CHANGES_FREELY,
    FILE_PATH,
    ConfigError,
    Section,
    format_validation_error,
    marks,
    mid_run,
    section_type,
)
from miles.config.data import DEFAULT_EVAL_PROMPTS, DataConfig, EvalConfig, EvalDatasetConfig
from miles.config.model import ModelConfig
from miles.config.rewards import JudgeConfig, RewardModelConfig
from miles.config.rollout import RolloutConfig
from miles.config.tracking import AlertsConfig, LoggingConfig
from miles.config.train import CriticConfig, TrainConfig
from miles.state.run_dir import RunDir
from miles.state.seeds import adapter_run_seed

# The settings a field left unset takes (RunConfig._preset). A built-in task: today's embedded-model values (4-token
# answers; a 0.5M-parameter model learns at 5e-4). The user's own data, on a pretrained model: the peers' common
# values (docs/guides/real-models.md, "Presets", says where each comes from).
EMBEDDED_TASK_PRESET: dict[tuple[str, str], Any] = {
    ("rollout", "max_new_tokens"): 4,
    ("train", "lr"): 5e-4,
    ("train", "adam_betas"): (0.9, 0.98),
    ("train", "gradient_checkpointing"): False,
    ("critic", "lr"): 2e-3,
}
OWN_DATA_PRESET: dict[tuple[str, str], Any] = {
    ("rollout", "max_new_tokens"): 1024,
    ("train", "lr"): 1e-6,
    ("train", "adam_betas"): (0.9, 0.999),
    ("train", "max_tokens_per_micro_batch"): 8192,
    ("train", "gradient_checkpointing"): True,
    ("critic", "lr"): 1e-5,
}


class ConfigChange(Section):
    """Values that take effect at `rollout_id` and after: a run's schedule of changes (`RunConfig.changes`), or a
    change made while the run was paused (recorded in run.json with who made it and why)."""

    rollout_id: int = Field(ge=0, description="the first rollout the values apply to")
    values: dict[str, Any] = Field(description="config field (dotted, e.g. train.lr) -> its value from rollout_id on")
    by: str = Field("", description="who made the change")
    reason: str = ""
    time: float | None = Field(None, description="when it was made (seconds since the epoch)")

    @field_validator("values")
    @classmethod
    def _mid_run_fields(cls, values: dict[str, Any]) -> dict[str, Any]:
        allowed = set(mid_run_fields().values())
        refused = sorted(set(values) - allowed)
        if refused:
            raise ValueError(
                f"{', '.join(refused)} cannot change in the middle of a run (what a stored rollout means would "
                f"change); these can: {', '.join(sorted(allowed))}"
            )
        return values


class RunConfig(Section):
    run_dir: str = Field("runs/tiny", json_schema_extra=FILE_PATH | CHANGES_FREELY)
    seed: int = 0
    num_rollout: int = Field(
        300,
        gt=0,
        description="total rollouts of the run (a resumed run goes on to this)",
        json_schema_extra=mid_run("num_rollout") | CHANGES_FREELY,
    )
    save_interval: int = Field(
        50,
        gt=0,
        description="checkpoint every N rollouts (and at the end)",
        json_schema_extra=mid_run("save_interval") | CHANGES_FREELY,
    )
    update_weights_interval: int = Field(1, gt=0, description="push weights to the engines every N rollouts")
    iterations_per_run: int | None = Field(
        None,
        gt=0,
        description="train at most this many rollouts per flow run, then checkpoint and exit (scheduled runs)",
        json_schema_extra=CHANGES_FREELY,
    )
    ray_address: str | None = Field(
        None, description="existing Ray cluster; unset starts a local one", json_schema_extra=CHANGES_FREELY
    )
    accept_config_change: bool = Field(
        False,
        description="resume a run whose config changed in a field that changes what a rollout or a step means "
        '(docs/getting-started.md, "Resuming a run"); unset: such a start is refused, with the difference',
        json_schema_extra=CHANGES_FREELY,
    )
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    train: TrainConfig = TrainConfig()
    critic: CriticConfig = CriticConfig()
    judge: JudgeConfig = JudgeConfig()
    reward_model: RewardModelConfig = RewardModelConfig()
    logging: LoggingConfig = Field(LoggingConfig(), json_schema_extra=CHANGES_FREELY)
    alerts: AlertsConfig = Field(AlertsConfig(), json_schema_extra=CHANGES_FREELY)
    eval: EvalConfig = Field(EvalConfig(), json_schema_extra=CHANGES_FREELY)
    adapters: list[AdapterConfig] = Field(
        default_factory=list,
        description="LoRA adapters of the multi-LoRA flow; unset on the embedded model: one per built-in task",
    )
    tenants: TenantsConfig = Field(TenantsConfig(), json_schema_extra=CHANGES_FREELY)
    changes: list[ConfigChange] = Field(
        default_factory=list,
        description="values that change at a given rollout (e.g. train.lr from rollout 50 on); a paused run's changes "
        "are recorded in its run.json and applied on top",
        json_schema_extra=CHANGES_FREELY,
    )
    _at_rollout: dict[int, RunConfig] = PrivateAttr(default_factory=dict)

    @field_validator("changes")
    @classmethod
    def _in_rollout_order(cls, changes: list[ConfigChange]) -> list[ConfigChange]:
        return sorted(changes, key=lambda change: change.rollout_id)

    def at(self, rollout_id: int) -> RunConfig:
        """The config in effect at `rollout_id`: `changes` due by then applied in order."""
        due = sum(1 for change in self.changes if change.rollout_id <= rollout_id)
        if not due:
            return self
        if due not in self._at_rollout:
            data = self.model_dump()
            for change in self.changes[:due]:
                for field, value in change.values.items():
                    *sections, name = field.split(".")
                    node = data
                    for section in sections:
                        node = node[section]
                    node[name] = value
            try:
                self._at_rollout[due] = RunConfig.model_validate(data)
            except ValidationError as err:
                raise ConfigError(format_validation_error(err, f"changes due at rollout {rollout_id}")) from None
        return self._at_rollout[due]

    @property
    def final(self) -> RunConfig:
        """The config once every change has taken effect (its num_rollout is where the run ends)."""
        return self.at(self.changes[-1].rollout_id) if self.changes else self

    def with_changes(self, changes: list[ConfigChange]) -> RunConfig:
        """This config with `changes` added to its schedule (those it holds already are not repeated)."""
        added = [change for change in changes if change not in self.changes]
        if not added:
            return self
        return RunConfig.model_validate({**self.model_dump(), "changes": [*self.changes, *added]})

    @model_validator(mode="after")
    def _preset(self) -> RunConfig:
        """The fields left unset take the preset of the run's data: a built-in task's (the embedded model's short
        answers), or the field's defaults for a model on the user's own data (docs/guides/real-models.md, "Presets")."""
        preset = EMBEDDED_TASK_PRESET if self.data.task is not None else OWN_DATA_PRESET
        for (section, name), value in preset.items():
            if getattr(getattr(self, section), name) is None:
                setattr(getattr(self, section), name, value)
        return self

    @model_validator(mode="after")
    def _batch_shapes(self) -> RunConfig:
        samples = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
        if samples % self.train.global_batch_size:
            raise ValueError(
                f"train.global_batch_size ({self.train.global_batch_size}) must divide "
                f"rollout.rollout_batch_size x rollout.n_samples_per_prompt ({samples})"
            )
        if self.algo.tis_clip_low > self.algo.tis_clip:
            raise ValueError(
                f"algo.tis_clip_low ({self.algo.tis_clip_low}) must not exceed algo.tis_clip ({self.algo.tis_clip})"
            )
        if self.algo.overlong_buffer_len is not None and self.algo.overlong_buffer_len > self.rollout.max_new_tokens:
            raise ValueError(
                f"algo.overlong_buffer_len ({self.algo.overlong_buffer_len}) must not exceed "
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens})"
            )
        if self.rollout.max_generate_rounds > 1 and not self.algo.dynamic_sampling:
            raise ValueError("rollout.max_generate_rounds > 1 draws more prompts only with algo.dynamic_sampling=true")
        if self.algo.dynamic_sampling and self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                "algo.dynamic_sampling needs rollout.n_samples_per_prompt >= 2: a group of one has no reward spread"
            )
        if self.train.global_batch_size % self.train.num_workers:
            raise ValueError(
                f"train.num_workers ({self.train.num_workers}) must divide "
                f"train.global_batch_size ({self.train.global_batch_size})"
            )
        if (
            self.rollout.weight_transport == "distributed"
            and self.rollout.device.split(":")[0] != self.train.device.split(":")[0]
        ):
            raise ValueError(
                f"rollout.weight_transport=distributed broadcasts from the trainer to the engines over one backend "
                f"(gloo on CPU, NCCL on CUDA): train.device ({self.train.device}) and rollout.device "
                f"({self.rollout.device}) must both be cpu or both cuda"
            )
        for reward, section in (("judge", self.judge), ("reward_model", self.reward_model)):
            if reward in self.rewards_used and section.model_path is None:
                raise ValueError(f"data.reward={reward} needs {reward}.model_path")
        if self.rollout.colocate and self.adapters:
            raise ValueError(
                "rollout.colocate=true pairs the engines with the policy's trainer ranks; the multi-LoRA flow's "
                "trainer groups take GPUs of their own: set rollout.colocate=false"
            )
        names = [adapter.name for adapter in self.adapters]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"adapters: names must be unique; repeated: {repeated}")
        return self

    def check_critic_group(self) -> None:
        """What a critic's trainer group needs, checked where the algorithm trains one (its advantage estimator says
        so: miles.train.algorithms.estimators; a config cannot tell without importing it)."""
        estimator = f"algo.advantage_estimator={self.algo.advantage_estimator}"
        if self.adapters:
            raise ConfigError(f"{estimator} trains a critic of the full model; adapters have none")
        if self.critic.num_workers > 1 and self.train.sharding == "none":
            raise ConfigError(f"critic.num_workers={self.critic.num_workers} needs train.sharding fsdp or unset")
        if self.train.global_batch_size % self.critic.num_workers:
            raise ConfigError(
                f"critic.num_workers ({self.critic.num_workers}) must divide "
                f"train.global_batch_size ({self.train.global_batch_size})"
            )

    @property
    def rewards_used(self) -> set[str]:
        """The rewards the run scores with: its data's, its eval data sets' and its adapters'."""
        data = [self.data, *(self.eval.datasets or []), *(a.data for a in self.adapters)]
        return {d.reward for d in data}

    def critic_view(self) -> RunConfig:
        """The run as the critic's trainer group sees it: critic.num_workers workers at critic.lr, with the policy
        trainer's other settings."""
        train = self.train.model_copy(update={"num_workers": self.critic.num_workers, "lr": self.critic.lr})
        return self.model_copy(update={"train": train, "run_dir": str(RunDir(self.run_dir).critic().path)})

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def eval_datasets(self) -> list[EvalDatasetConfig]:
        """The evaluation data sets in effect: eval.datasets, else a greedy sample of a built-in training task."""
        if self.eval.datasets is not None:
            return list(self.eval.datasets)
        if self.data.task is None:
            return []
        return [EvalDatasetConfig(name=self.data.task, task=self.data.task, max_prompts=DEFAULT_EVAL_PROMPTS)]

    def should_evaluate(self, rollout_id: int) -> bool:
        """Whether the evaluation schedule has one at rollout `rollout_id` (before training it; num_rollout: the end)."""
        if not self.eval_datasets or not 0 <= rollout_id <= self.num_rollout:
            return False
        if rollout_id == 0:
            return self.eval.before_training
        interval = self.eval.interval
        return rollout_id == self.num_rollout or (interval is not None and rollout_id % interval == 0)

    def adapter_view(self, adapter: AdapterConfig) -> RunConfig:
        """The run as one adapter sees it: its data, batch sizes, lr, step budget and seed, in <run_dir>/adapters/<name>."""
        samples = adapter.rollout_batch_size * adapter.n_samples_per_prompt
        global_batch = adapter.global_batch_size or samples
        data = self.model_dump()
        data.update(
            run_dir=str(RunDir(self.run_dir).adapter(adapter.name).path),
            seed=adapter_run_seed(self.seed, adapter.name),
            num_rollout=adapter.num_steps,
            data=adapter.data.model_dump(),
            eval=adapter.eval.model_dump(),
            adapters=[],
            changes=[],
        )
        data["rollout"].update(
            rollout_batch_size=adapter.rollout_batch_size, n_samples_per_prompt=adapter.n_samples_per_prompt
        )
        data["train"].update(
            lr=adapter.lr,
            global_batch_size=global_batch,
            micro_batch_size=min(self.train.micro_batch_size, global_batch),
        )
        try:
            return RunConfig.model_validate(data)
        except ValidationError as err:
            raise ConfigError(format_validation_error(err, f"adapter {adapter.name!r}")) from None


def mid_run_fields(schema: type[Section] | None = None, prefix: str = "") -> dict[str, str]:
    """The fields a paused run may change (marked `mid_run`), by their name in the pause form: {'lr': 'train.lr', ...}."""
    found = {}
    for name, info in (schema or RunConfig).model_fields.items():
        form_name = marks(info).get("mid_run")
        if form_name is not None:
            found[form_name] = f"{prefix}{name}"
        section = section_type(info.annotation)
        if section is not None and info.annotation is section:
            found |= mid_run_fields(section, f"{prefix}{name}.")
    return found
