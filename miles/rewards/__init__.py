"""Reward functions by name, or any `pkg.mod:name` of the same shape.

A reward is either
- per sample: `fn(response: str, label: str, finished: bool) -> float`, a plain or an `async` function; or
- batched: an object with `score_batch(responses, labels, finished) -> list[float]`, plain or `async` (a remote
  verifier called once per rollout, not once per sample).
`response` is the decoded response without special tokens; `finished` is False when the response hit
max_new_tokens before its stop token. `miles.rewards.scoring.RewardScorer` runs them with a time limit.
"""

from __future__ import annotations

from collections.abc import Callable

from miles.registry import check_name, import_object
from miles.rewards.verifiers import gsm8k_answer, math_answer

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


def resolve_reward(name: str) -> RewardFn | object:
    """The built-in reward `name`, or the function or batched reward object at import path `name`."""
    try:
        check_name(name, list(REWARDS))
    except ValueError as exc:
        raise ValueError(f"data.reward: {exc}") from None
    if name in REWARDS:
        return REWARDS[name]
    reward = import_object("data.reward", name)
    if not callable(reward) and not callable(getattr(reward, "score_batch", None)):
        raise ValueError(f"data.reward: {name!r} is not callable and has no score_batch method")
    return reward
