"""DAPO's rollout-side pieces (Yu et al. 2025, DAPO: An Open-Source LLM Reinforcement Learning System at Scale,
arXiv:2503.14476): the group filter of dynamic sampling and overlong reward shaping."""

from __future__ import annotations

import torch


def equal_score_groups(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Per sample: whether every sample of its group has the same score (a group of one included).

    Such a group has zero advantage under a group baseline and gives no gradient: dynamic sampling (section 3.2,
    eq. 11: 0 < |{correct}| < G) leaves it out and samples more prompts instead.
    """
    _, inverse = torch.unique(groups, return_inverse=True)
    count = int(inverse.max()) + 1 if len(inverse) else 0
    low = torch.full((count,), torch.inf, dtype=scores.dtype).scatter_reduce(0, inverse, scores, "amin")
    high = torch.full((count,), -torch.inf, dtype=scores.dtype).scatter_reduce(0, inverse, scores, "amax")
    return (low == high)[inverse]


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """Soft overlong punishment (section 3.4, eq. 13), scaled by `factor`: 0 for a response of at most
    max_length - buffer tokens, then falling linearly to -factor at max_length (and -factor beyond)."""
    excess = (lengths.to(torch.float64) - (max_length - buffer)).clamp(min=0)
    return -factor * (excess / buffer).clamp(max=1.0)
