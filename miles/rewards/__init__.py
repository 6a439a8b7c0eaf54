"""Reward functions by name, or any `pkg.mod:fn` with the same signature.

A reward function is `fn(response: str, label: str, finished: bool) -> float`: `response` is the decoded
response without special tokens, `finished` is False when the response hit max_new_tokens before EOS.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

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
    if name in REWARDS:
        return REWARDS[name]
    module_name, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(f"data.reward: unknown reward {name!r}; use one of {sorted(REWARDS)} or 'pkg.mod:fn'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"data.reward: cannot import {name!r}: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"data.reward: {name!r} is not callable")
    return fn
