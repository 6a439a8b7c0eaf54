"""How a rollout's samples are produced: a generate function takes the engine client and a batch of samples and
returns one SampleRecord per sample (tokens, log-probs, loss mask, reward, status).

The built-ins are `single_turn` (one completion per prompt, scored by `data.reward`) and
`miles.rollout.episodes:run_episodes` (multi-turn episodes in `rollout.env`); `rollout.generate_fn: pkg.mod:fn`
names a function of the same shape, as miles and slime allow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from transformers import AutoConfig

from miles.config import DataConfig, RunConfig
from miles.data.prompts import Prompt, PromptFormatter
from miles.engines.base import GenerateRequest, GenerateResult, SamplingParams, eos_token_ids
from miles.registry import import_callable
from miles.rewards import RewardFn
from miles.rewards.scoring import RewardScorer, clip

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutSample:
    """One sample to produce: its data row (`prompt`, `label`, any other column), its seed, how to sample it."""

    row: dict[str, Any]
    seed: int
    sampling: SamplingParams
    adapter: str | None = None


@dataclass
class SampleRecord:
    """What a generate function gives for one sample. `response_ids` is every token after the prompt; per token,
    `loss_mask` is 1 where the model generated it (trained on) and 0 where the environment did, and
    `rollout_logprobs` the engine's log-prob (0.0 where the mask is 0). `reward` is None when scoring failed
    (`status` is then `failed`); `token_rewards`, where the generate function credits parts of it to tokens (an
    episode's turns), is the reward at each response token, adding up to `reward`. `weight_versions` is each token's weight version (an environment's token takes
    the version of the model turn before it), `weight_version` the oldest of them; without `weight_versions`, every
    token is of `weight_version`."""

    prompt: str | None  # the text the model was given (None where unknown)
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    loss_mask: list[int]
    reward: float | None
    status: str  # completed, truncated, failed
    weight_version: int
    num_turns: int = 1
    end_reason: str = "done"  # miles.envs.base.END_REASONS
    weight_versions: list[int] | None = None
    token_rewards: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if self.token_rewards is not None and len(self.token_rewards) != n:
            raise ValueError(
                f"a sample record's token_rewards needs one entry per response token: {n} tokens, {len(self.token_rewards)} entries"
            )
        if self.weight_versions is None:
            self.weight_versions = [self.weight_version] * n
        if len(self.rollout_logprobs) != n or len(self.loss_mask) != n or len(self.weight_versions) != n:
            raise ValueError(
                f"a sample record needs one log-prob, one mask entry and one weight version per response token: {n} "
                f"tokens, {len(self.rollout_logprobs)} log-probs, {len(self.loss_mask)} mask entries, "
                f"{len(self.weight_versions)} weight versions"
            )
        if n and min(self.weight_versions) != self.weight_version:
            raise ValueError(
                f"a sample record's weight_version ({self.weight_version}) is the oldest of its weight_versions "
                f"({min(self.weight_versions)})"
            )

    @classmethod
    def completion(
        cls, prompt: str | None, prompt_ids: list[int], result: GenerateResult, reward: float | None, finished: bool
    ) -> SampleRecord:
        """One completion of a prompt, every token trained on: `done` when it ended at a stop token (`finished`),
        else cut at max_new_tokens (`truncated`); `failed` when its reward failed (None)."""
        return cls(
            prompt=prompt,
            prompt_ids=prompt_ids,
            response_ids=result.output_ids,
            rollout_logprobs=result.logprobs,
            loss_mask=[1] * len(result.output_ids),
            reward=reward,
            status="failed" if reward is None else "completed" if finished else "truncated",
            weight_version=result.weight_version,
            end_reason="done" if finished else "max_new_tokens",
            weight_versions=result.weight_versions,
        )


class GenerateClient:
    """What a generate function works with: the engines (`generate`, batched on the engines with every concurrent
    caller's requests), the tokenizer and prompt formatting, the run's reward and config."""

    def __init__(
        self, controller, tokenizer, config: RunConfig, reward: RewardFn | object, data: DataConfig | None = None
    ):
        self.controller = controller
        self.tokenizer = tokenizer
        self.config = config
        self.data = data or config.data  # the data set sampled: the training data, or an eval data set
        self.prompts = PromptFormatter(tokenizer, self.data)
        self.scorer = RewardScorer(reward, self.data.reward_timeout_s, self.data.reward_concurrency)
        self.stop_token_ids = eos_token_ids(tokenizer)
        self.context = "rollout"  # names the work in log lines ("rollout 12"); the executor sets it per round

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return self.controller.generate(requests)

    def weight_version(self) -> int:
        return self.controller.weight_version()

    @cached_property
    def context_length(self) -> int:
        """The model's context (max_position_embeddings): a prompt and its response fit in it together."""
        return AutoConfig.from_pretrained(self.tokenizer.name_or_path).max_position_embeddings

    def encode_prompts(self, prompts: list[Prompt]) -> tuple[list[str], list[list[int]]]:
        return self.prompts.encode(prompts)

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return self.tokenizer.batch_decode([list(i) for i in ids], skip_special_tokens=True)

    def stopped(self, result: GenerateResult) -> bool:
        """The engine ended the turn on one of the model's stop tokens (not at max_new_tokens)."""
        return (
            result.finish_reason == "stop" and bool(result.output_ids) and result.output_ids[-1] in self.stop_token_ids
        )

    def score(
        self, prompts: list[str], responses: list[str], labels: list[str], finished: list[bool]
    ) -> list[float | None]:
        """`data.reward` of each response to its prompt (None where it failed; the first failure is logged)."""
        rewards, failures = self.scorer.score(prompts, responses, labels, finished)
        if failures:
            index, why = failures[0]
            log.warning(
                "%s: reward %r failed on %d of %d samples (stored as failed: not trained on, not passing); "
                "first: sample %d (response %s) %s",
                self.context,
                self.data.reward,
                len(failures),
                len(responses),
                index,
                clip(repr(responses[index])),
                why,
            )
        return rewards


GenerateFn = Callable[[GenerateClient, list[RolloutSample]], list[SampleRecord]]


def single_turn(client: GenerateClient, samples: list[RolloutSample]) -> list[SampleRecord]:
    """One completion per sample, every token trained on, scored by `data.reward`."""
    # The n samples of a prompt share its row: each prompt is formatted and tokenized once.
    prompts = {id(s.row): s.row["prompt"] for s in samples}
    unique_texts, unique_ids = client.encode_prompts(list(prompts.values()))
    at = {row: k for k, row in enumerate(prompts)}
    texts = [unique_texts[at[id(s.row)]] for s in samples]
    prompt_ids = [unique_ids[at[id(s.row)]] for s in samples]
    requests = [
        GenerateRequest(prompt_ids=ids, sampling=s.sampling, adapter=s.adapter, seed=s.seed)
        for s, ids in zip(samples, prompt_ids, strict=True)
    ]
    results = client.generate(requests)
    finished = [client.stopped(r) for r in results]
    responses = client.decode([r.output_ids for r in results])
    rewards = client.score(texts, responses, [s.row["label"] for s in samples], finished)
    return [
        SampleRecord.completion(text, ids, result, reward, done)
        for text, ids, result, reward, done in zip(texts, prompt_ids, results, rewards, finished, strict=True)
    ]


def resolve_generate_fn(config: RunConfig) -> GenerateFn:
    """rollout.generate_fn when set, else the episode runner when rollout.env is set, else single_turn."""
    if config.rollout.generate_fn is not None:
        return import_callable("rollout.generate_fn", config.rollout.generate_fn)
    if config.rollout.env is not None:
        from miles.envs.base import resolve_environment
        from miles.rollout.episodes import run_episodes

        resolve_environment(config.rollout.env)  # refused here, before any work, when it cannot be imported
        return run_episodes
    return single_turn
