"""Per-token log-probs and entropies of a causal LM's logits, over [B, T] token grids."""

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


def token_entropy(log_softmax: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The entropy of the distribution that produced each token where `mask` ([B, T]) is set, 0 elsewhere ([B, T]);
    only those positions pay the vocabulary-wide work."""
    at = mask[:, 1:].bool()
    chosen = log_softmax[at]
    entropy = torch.zeros(at.shape, dtype=log_softmax.dtype, device=log_softmax.device)
    entropy = entropy.masked_scatter(at, -(chosen.exp() * chosen).sum(dim=-1))
    return torch.nn.functional.pad(entropy, (1, 0))
