"""Loss aggregations: per-token terms -> one optimizer step's loss.

Signature (built-ins and `pkg.mod:fn` alike): `aggregate(values, mask, scale) -> scalar`, where `values` and `mask`
are one micro-batch's [B, T] terms and `scale` holds the denominators of the whole global batch (one optimizer
step). Every built-in is a sum over the micro-batch divided by a global-batch constant, so the micro-batches of a
step add up to the same loss whatever micro_batch_size is (and, later, however many workers share the step).
A sample with no trained token counts as a sequence with loss 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossScale:
    """The global batch's denominators."""

    tokens: float  # trained tokens in the global batch
    sequences: int  # samples in the global batch
    horizon: int  # Dr. GRPO's constant length: the generation budget of a sample (rollout.max_model_tokens)


def token_mean(values: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """sum_i sum_t l_it / sum_i |y_i|: every token weighs the same (DAPO, Yu et al. 2025, arXiv:2503.14476, eq. 8)."""
    return (values * mask).sum() / scale.tokens


def token_sum(values: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """sum_i sum_t l_it: no normalisation, so the step grows with the batch's tokens (verl's token-sum; for a
    learning rate tuned to it, or a custom normalisation outside)."""
    return (values * mask).sum()


def seq_mean_token_sum(values: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """(1/G) sum_i sum_t l_it: each sequence's token sum, averaged over sequences (verl's seq-mean-token-sum)."""
    return (values * mask).sum() / scale.sequences


def seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """(1/G) sum_i (1/|y_i|) sum_t l_it: each sequence weighs the same (GRPO as written, Shao et al. 2024,
    arXiv:2402.03300, eq. 3; GSPO, Zheng et al. 2025, arXiv:2507.18071, eq. 5)."""
    per_sequence = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_sequence.sum() / scale.sequences


def seq_mean_token_sum_norm(values: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """(1/(G L)) sum_i sum_t l_it with L the generation budget: no length normalisation per sequence (Dr. GRPO,
    Liu et al. 2025, arXiv:2503.20783, section 3.2, whose constant is MAX_TOKENS)."""
    return (values * mask).sum() / (scale.sequences * scale.horizon)
