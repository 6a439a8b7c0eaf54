"""Reward functions by name, or any `pkg.mod:name` of the same shape.

A reward is either
- per sample: `fn(response: str, label: str, finished: bool) -> float`, a plain or an `async` function; or
- batched: an object with `score_batch(prompts, responses, labels, finished) -> list[float]`, plain or `async` (a
  remote verifier, a judge or a reward model, called once per rollout, not once per sample).
`response` is the decoded response without special tokens; `prompt` the prompt as the model saw it (templated);
`finished` is False when the response hit max_new_tokens before its stop token. `miles.rewards.scoring.RewardScorer` runs them with a time limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from miles.registry import check_name, import_object
from miles.rewards.verifiers import gsm8k_answer, math_answer

if TYPE_CHECKING:
    from miles.config import RunConfig

RewardFn = Callable[[str, str, bool], float]


def exact_match(response: str, label: str, finished: bool) -> float:
    return 1.0 if finished and response.strip() == label.strip() else 0.0


def digit_match(response: str, label: str, finished: bool) -> float:
    """Partial credit: share of right-aligned digits that match, 0 without EOS."""
    response, label = response.strip(), label.strip()
    if not finished or not response:
        return 0.0
    width = max(len(response), len(label))
    hits = sum(r == l for r, l in zip(reversed(response), reversed(label), strict=False))
    return hits / width


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "digit_match": digit_match,
    "math": math_answer,
    "gsm8k": gsm8k_answer,
}


MODEL_REWARDS = ("judge", "reward_model")  # batched rewards computed by models, set up by their config sections


def resolve_reward(name: str, config: RunConfig) -> RewardFn | object:
    """The built-in reward `name` (a model's with its settings in `config`: miles.rewards.models), or the function or
    batched reward object at import path `name`."""
    try:
        check_name(name, [*REWARDS, *MODEL_REWARDS])
    except ValueError as exc:
        raise ValueError(f"data.reward: {exc}") from None
    if name in REWARDS:
        return REWARDS[name]
    if name == "judge":
        from miles.rewards.models import GenerativeJudge

        return GenerativeJudge(config.judge, config.rollout)
    if name == "reward_model":
        from miles.rewards.models import RewardModel

        return RewardModel(config.reward_model)
    reward = import_object("data.reward", name)
    if not callable(reward) and not callable(getattr(reward, "score_batch", None)):
        raise ValueError(f"data.reward: {name!r} is not callable and has no score_batch method")
    return reward


def close_rewards(*rewards: RewardFn | object) -> None:
    """Stop what the rewards started (a judge's engines, a reward model's actor)."""
    for reward in rewards:
        close = getattr(reward, "close", None)
        if callable(close):
            close()
