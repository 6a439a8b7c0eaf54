"""Advantage estimators over whole rollouts, vectorised over groups."""

from __future__ import annotations

import numpy as np


def grpo_advantages(
    rewards: np.ndarray, groups: np.ndarray, std_normalization: bool = True, eps: float = 1e-6
) -> np.ndarray:
    """(r - mean of its group) / (std of its group + eps); std is the unbiased one, 0 for a group of one."""
    rewards = rewards.astype(np.float64)
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=rewards)
    means = sums / counts
    centred = rewards - means[inverse]
    if not std_normalization:
        return centred.astype(np.float32)
    sq = np.bincount(inverse, weights=centred**2)
    std = np.sqrt(np.divide(sq, counts - 1, out=np.zeros_like(sq), where=counts > 1))
    return (centred / (std[inverse] + eps)).astype(np.float32)
