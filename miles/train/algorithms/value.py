"""The critic's side of PPO: generalized advantage estimation over a response's trained tokens, advantage whitening,
and the clipped value loss. Pure tensor functions over [B, T] token grids; `mask` marks the trained tokens.

Conventions, written down once:
- Tokens outside the mask (environment tokens of an episode, padding) are skipped, not zeroed: a trained token's
  next value is the value at the next trained token, and the value after the last one is 0 (the episode ends).
- Whitening shifts the mean and uses the unbiased variance over the trained tokens of the whole batch, with 1e-8
  added under the square root, as verl's masked_whiten.
- The value loss is 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) per token; the aggregation is the
  run's.
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T] and 0 outside the mask: A_t = sum_l (gamma lam)^l delta_(t+l) with
    delta_t = r_t + gamma V_(t+1) - V_t, and R_t = A_t + V_t, the critic's target.

    Schulman et al. 2016, High-Dimensional Continuous Control Using Generalized Advantage Estimation
    (arXiv:1506.02438), eq. 16. gamma = lam = 1 makes A_t the undiscounted return to go minus V_t.
    """
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        trained = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        running = torch.where(trained > 0, step, running)
        next_value = torch.where(trained > 0, values[:, t], next_value)
        advantages[:, t] = step * trained
    return advantages, (advantages + values) * mask


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the trained tokens of the batch (unbiased variance); 0 outside the mask."""
    mask = mask.to(values.dtype)
    count = mask.sum()
    mean = (values * mask).sum() / count.clamp(min=1)
    variance = (((values - mean) * mask) ** 2).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(variance + WHITEN_EPS) * mask


def value_loss(
    predicted: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per_token, clipped): 0.5 (V - R)^2, or with `clip` the larger of that and the loss of V clipped to
    [V_old - clip, V_old + clip]; `clipped` marks the tokens where the clipped term wins (they have no gradient).

    Value clipping as in OpenAI's PPO implementation (baselines ppo2), discussed by Engstrom et al. 2020,
    Implementation Matters in Deep Policy Gradients (arXiv:2005.12729); verl's critic.cliprange_value.
    """
    unclipped = (predicted - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    bounded = old_values + (predicted - old_values).clamp(-clip, clip)
    clipped_loss = (bounded - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped_loss), clipped_loss > unclipped
