"""The model rewards: the judge section (a generative judge) and the reward_model section."""

from __future__ import annotations

from pydantic import Field

from miles.config.base import CHANGES_FREELY, FILE_PATH, IMPORT_PATH, Section

DEFAULT_JUDGE_TEMPLATE = (
    "Question: {prompt}\nReference answer: {label}\nAnswer to judge: {response}\n"
    "Is the answer to judge correct? Reply yes or no.\n"
)


class JudgeConfig(Section):
    """The generative judge (data.reward=judge): a model of its own, served by engines of its own (the rollout's
    engine kind, device and dtype), asked for a verdict on each sample of a rollout round in one batch."""

    model_path: str | None = Field(None, json_schema_extra=FILE_PATH, description="the judge: a Hugging Face causal LM")
    num_engines: int = Field(1, gt=0, description="engines serving the judge", json_schema_extra=CHANGES_FREELY)
    prompt_template: str = Field(
        DEFAULT_JUDGE_TEMPLATE, description="the judge's prompt: str.format fields {prompt}, {response} and {label}"
    )
    apply_chat_template: bool = Field(False, description="give the prompt as a user message in the judge's template")
    system_prompt: str | None = Field(None, description="a system message before it (with apply_chat_template)")
    verdict: str = Field(
        "yes_no",
        json_schema_extra=IMPORT_PATH,
        description="how the judge's reply becomes a reward: yes_no (its first yes or no: 1 or 0), score (its first "
        "number), same_answer (1 when the judge's own answer, stripped, is the response's), or 'pkg.mod:fn' "
        "(reply, response, label) -> float or None; a reply it cannot read fails its sample",
    )
    max_new_tokens: int = Field(16, gt=0, description="the judge's reply, at most (greedy)")


class RewardModelConfig(Section):
    """The reward model (data.reward=reward_model): a sequence-classification model's score of prompt + response, run
    batched in a Ray actor of its own."""

    model_path: str | None = Field(
        None, json_schema_extra=FILE_PATH, description="a Hugging Face sequence-classification model of one label"
    )
    batch_size: int = Field(32, gt=0, description="samples per forward", json_schema_extra=CHANGES_FREELY)
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", json_schema_extra=CHANGES_FREELY)
    num_threads: int = Field(
        2, gt=0, description="torch threads of the reward model's actor", json_schema_extra=CHANGES_FREELY
    )
