"""Reward functions, by import path, that fail on chosen labels: each label names how it fails."""

from __future__ import annotations

from miles.rewards import digit_match

BAD_RETURNS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "none": None, "text": "1.0"}


def fails_on_some_labels(response: str, label: str, finished: bool):
    if label == "raise":
        raise RuntimeError(f"cannot score {response!r}")
    if label in BAD_RETURNS:
        return BAD_RETURNS[label]
    return digit_match(response, label, finished)


def always_raises(response: str, label: str, finished: bool) -> float:
    raise KeyError(label)


def interrupted(response: str, label: str, finished: bool) -> float:
    raise KeyboardInterrupt


def constant_unless_differ(response: str, label: str, finished: bool) -> float:
    """1 on every sample of a prompt labelled "same" (a group without reward spread); the response read as a number
    on any other."""
    return 1.0 if label == "same" else float(response)
