"""Policy-gradient loss pieces as plain tensor functions over [B, T] token grids and a token mask."""

from __future__ import annotations

import torch


def next_token_log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-softmax of the distribution that produced the token at each position t >= 1 ([B, T-1, V], float32).

    The division is skipped at temperature 1: it would copy the whole logits tensor (and its gradient) for nothing.
    """
    scaled = logits[:, :-1].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    return torch.log_softmax(scaled, dim=-1)


def picked_logprobs(log_softmax: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of tokens[:, t] given the prefix, at position t ([B, T]; position 0 has none and is 0)."""
    picked = log_softmax.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return picked_logprobs(next_token_log_softmax(logits, temperature), tokens)


def masked_entropy(log_softmax: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over the positions where `mask` ([B, T]) is set of the entropy of the distribution that produced that
    token; only those positions pay the vocabulary-wide work."""
    chosen = log_softmax[mask[:, 1:].bool()]
    return -(chosen.exp() * chosen).sum()


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over masked tokens of the clipped surrogate max(-A r, -A clip(r)), and the count of clipped tokens.

    `token_weights` (e.g. TIS weights) multiply each token's term.

    `advantages` is per sequence ([B]) or per token ([B, T]). Sums, not means, so that micro-batches add
    up to the global batch's token mean when the caller divides by its token count.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * token_weights
    return (per_token * mask).sum(), ((clipped > unclipped) * mask).sum()


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over masked tokens of the k3 estimator of KL(policy || ref): exp(d) - d - 1 with d = ref - logp."""
    delta = ref_logprobs - logprobs
    return ((torch.exp(delta) - delta - 1.0) * mask).sum()


def tis_weights(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """Truncated importance weights exp(trainer_old - rollout) clamped to [low, high]; no gradient flows."""
    return torch.exp(trainer_logprobs - rollout_logprobs).clamp(low, high).detach()
