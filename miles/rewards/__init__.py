"""Reward functions by name, or any `pkg.mod:fn` with the same signature.

A reward function is `fn(response: str, label: str, finished: bool) -> float`: `response` is the decoded
response without special tokens, `finished` is False when the response hit max_new_tokens before EOS.
"""

from __future__ import annotations

from collections.abc import Callable

from miles.registry import check_name, import_callable

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


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "digit_match": digit_match}


def resolve_reward(name: str) -> RewardFn:
    try:
        check_name(name, list(REWARDS))
    except ValueError as exc:
        raise ValueError(f"data.reward: {exc}") from None
    return REWARDS[name] if name in REWARDS else import_callable("data.reward", name)
