"""The data a run trains and evaluates on: the data section, and the eval section's data sets."""

from __future__ import annotations

from pydantic import Field, model_validator

from miles.config.base import CHANGES_FREELY, FILE_PATH, IMPORT_PATH, Section, mid_run


class DataConfig(Section):
    task: str | None = Field("addition", description="built-in task (see miles.envs); unset when `path` is given")
    path: str | None = Field(
        None,
        json_schema_extra=FILE_PATH,
        description="prompt data: a .jsonl, .parquet or .arrow file, a directory saved by Hugging Face datasets, "
        "or a directory or glob of parquet shards",
    )
    split: str | None = Field(None, description="the split of a saved DatasetDict or of sharded data; unset: train")
    prompt_key: str = Field("prompt", description="prompt column: a string, or chat messages [{role, content}, ...]")
    apply_chat_template: bool | None = Field(
        None,
        description="format prompts with the tokenizer's chat template (add_generation_prompt); unset: chat "
        "messages are, strings are not",
    )
    system_prompt: str | None = Field(None, description="a system message put before each templated prompt")
    label_key: str | None = Field(
        "label", description="label column; null for data without labels (a reward that needs none)"
    )
    shuffle: bool = True
    reward: str = Field(
        "exact_match",
        json_schema_extra=IMPORT_PATH,
        description="exact_match, digit_match, math (math-verify), gsm8k, judge (a generative judge: the judge "
        "section), reward_model (the reward_model section), or an import path 'pkg.mod:name' of a reward function "
        "(plain or async) or of an object with score_batch",
    )
    reward_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a reward call slower than this fails its samples (stored as failed, not trained on)",
        json_schema_extra=CHANGES_FREELY,
    )
    reward_concurrency: int = Field(
        16, gt=0, description="per-sample reward calls in flight at once", json_schema_extra=CHANGES_FREELY
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.task is None) == (self.path is None):
            raise ValueError("set exactly one of data.task and data.path")
        return self


class EvalDatasetConfig(DataConfig):
    """One evaluation data set: data as for training (a built-in task or a path, its columns, template and reward),
    how it is sampled, and how much of it is used."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,39}$", description="lowercase letters, digits and dashes")
    task: str | None = Field(None, description="built-in task (see miles.envs); unset when `path` is given")
    n_samples_per_prompt: int = Field(1, gt=0, description="samples per prompt: pass@k is reported for k up to this")
    temperature: float = Field(0.0, ge=0, description="0: greedy decoding")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int | None = Field(None, gt=0, description="unset: rollout.max_new_tokens")
    max_prompts: int | None = Field(
        None,
        gt=0,
        description="evaluate on this many prompts (a seeded sample when `shuffle`, else the first); unset: all",
    )
    pass_threshold: float = Field(1.0, description="a sample passes (for pass@k) when its reward is at least this")

    @model_validator(mode="after")
    def _greedy_once(self) -> EvalDatasetConfig:
        if self.temperature == 0 and self.n_samples_per_prompt > 1:
            raise ValueError(
                f"temperature 0 decodes greedily: the {self.n_samples_per_prompt} samples of a prompt would be alike; "
                "set n_samples_per_prompt=1 or a temperature above 0"
            )
        return self


DEFAULT_EVAL_PROMPTS = 200


class EvalConfig(Section):
    """Evaluation during training, on the engines holding the current weights. The evaluation at rollout N uses
    weight version N (trained on rollouts 0..N-1: the weights that generate rollout N in the sync flow)."""

    interval: int | None = Field(
        None,
        gt=0,
        description="evaluate every N rollouts; unset: only before training and at the end",
        json_schema_extra=mid_run("eval_interval"),
    )
    before_training: bool = Field(True, description="evaluate the starting weights (rollout 0)")
    datasets: list[EvalDatasetConfig] | None = Field(
        None,
        description="unset: for a built-in data.task, 200 of its prompts, greedy; for data.path, none; [] turns "
        "evaluation off",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> EvalConfig:
        names = [dataset.name for dataset in self.datasets or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"eval.datasets: names must be unique; repeated: {repeated}")
        return self
