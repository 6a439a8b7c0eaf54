"""Alerts on a run's iterations: an unhealthy iteration, and a reward that collapsed. Pure functions of the iteration
records (metrics.jsonl lines); the flows emit an event for each alert (control/events.py).

Conventions: an iteration is unhealthy when a watched value it has (WATCHED) is NaN or infinite, or when the reward
failed on at least alerts.failed_reward_fraction of its samples (a reward that returns NaN or infinity, raises or times
out: such a sample is stored as failed and left out of training, so a NaN reward never reaches the loss). A collapse compares window
means of `reward_collapse_window` iterations: the latest window's mean is below (1 - reward_collapse_drop) times the
best earlier window's, and that best was above zero (a reward that never rose cannot collapse). It is reported once,
and again only after the reward recovered above the threshold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from miles.config import AlertsConfig

WATCHED = ("reward_mean", "loss", "grad_norm", "pg_loss", "kl_ref", "entropy")


def unhealthy(record: dict[str, Any], alerts: AlertsConfig) -> list[str]:
    """What is wrong with an iteration, by its record: each watched value that is not finite, and the share of
    samples whose reward failed when it reaches alerts.failed_reward_fraction; empty when nothing is."""
    found = [f"{key} is {record[key]}" for key in WATCHED if _not_finite(record.get(key))]
    samples, failed = record.get("samples"), record.get("failed_samples", 0)
    if samples and failed / samples >= alerts.failed_reward_fraction:
        found.append(f"the reward failed on {failed} of {samples} samples")
    return found


def _not_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


class RewardCollapse:
    """Follows a run's reward_mean, iteration by iteration; `update` says when it has just collapsed."""

    def __init__(self, alerts: AlertsConfig, history: Sequence[float] = ()):
        self.window = alerts.reward_collapse_window
        self.keep = 1 - alerts.reward_collapse_drop
        self.rewards: list[float] = [r for r in history if math.isfinite(r)]
        self.collapsed = False

    def update(self, reward_mean: float) -> dict[str, float] | None:
        """None, or (on the iteration that collapses) the latest and best window means and the threshold."""
        if not math.isfinite(reward_mean):
            return None
        self.rewards.append(reward_mean)
        if len(self.rewards) < 2 * self.window:
            return None
        latest = _mean(self.rewards[-self.window :])
        best = max(_mean(self.rewards[i : i + self.window]) for i in range(len(self.rewards) - 2 * self.window + 1))
        threshold = self.keep * best
        below = best > 0 and latest < threshold
        just_collapsed = below and not self.collapsed
        self.collapsed = below
        return {"latest": latest, "best": best, "threshold": threshold} if just_collapsed else None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
