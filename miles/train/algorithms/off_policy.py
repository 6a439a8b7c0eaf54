"""Off-policy correction for the gap between the engine that sampled a rollout and the trainer.

The loss is computed against the trainer's old policy pi_old (its recompute of the rollout's log-probs), but the
tokens were sampled by the engine's pi_rollout (other kernels, other precision, or older weights in the async
flow). Each token's loss is weighted by w = pi_old / pi_rollout, bounded to [algo.tis_clip_low, algo.tis_clip]:

- `algo.tis_level`: `token` weighs each token by its own ratio (truncated importance sampling, Yao et al. 2025,
  Your Efficient RL Framework Secretly Brings You Off-Policy RL Training, fengyao.notion.site/off-policy-rl);
  `sequence` weighs every token of a sample by the product of its token ratios (sequence-level IS, Liu, Li et al.
  2025, When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch).
- `algo.tis_mode`: `clamp` truncates a weight outside the bounds to the nearest bound (TIS); `mask` sets it to 0,
  so the token (or sample) is left out of the loss (masked importance sampling, the same 2025 paper).

Rejection (`algo.rejection_level`, beside or instead of TIS): a token, or a whole sample, whose gap between the two
policies is too large is left out of the loss (weight 0; it still counts in the aggregation's denominators, as a
masked TIS weight does). The gap per token is an estimate of KL(pi_rollout || pi_old) from d = log pi_old -
log pi_rollout on the sampled token (`algo.rejection_estimator`: k1 |d|, k2 d^2 / 2, k3 exp(-d) + d - 1; Schulman
2020, Approximating KL Divergence); `sequence` takes the mean over the sample's trained tokens. A gap above
`algo.rejection_threshold` rejects (Liu, Li et al. 2025, When Speed Kills Stability, geometric-mean rejection at the
sequence level; verl's rollout rejection sampling). It needs the trainer's recompute (`use_rollout_logprobs` off).

Log-ratios are clamped to [-20, 20] before exp. No gradient flows through the weights. With
`algo.use_rollout_logprobs` the old policy is pi_rollout itself, the PPO ratio already corrects, and no weight
is applied (it would correct twice).
"""

from __future__ import annotations

import torch

from miles.train.algorithms.policy_losses import LOG_RATIO_LIMIT


def importance_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, algo
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bounded weights ([B, T]) and where the bound changed a weight ([B, T] bool)."""
    log_ratio = (old_logprobs - rollout_logprobs).detach()
    if algo.tis_level == "sequence":
        log_ratio = (log_ratio * mask).sum(dim=1, keepdim=True).expand_as(log_ratio)
    raw = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    if algo.tis_mode == "clamp":
        weights = raw.clamp(algo.tis_clip_low, algo.tis_clip)
    else:
        weights = torch.where((raw >= algo.tis_clip_low) & (raw <= algo.tis_clip), raw, 0.0)
    return weights, weights != raw


def _gap(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return log_ratio.abs()
    if estimator == "k2":
        return 0.5 * log_ratio**2
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(-log_ratio) + log_ratio - 1.0


def kept_by_rejection(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, algo
) -> torch.Tensor:
    """[B, T] bool: the tokens rejection keeps (all of them with rejection_level off)."""
    if algo.rejection_level == "off":
        return torch.ones_like(mask, dtype=torch.bool)
    gap = _gap((old_logprobs - rollout_logprobs).detach(), algo.rejection_estimator)
    if algo.rejection_level == "sequence":
        gap = ((gap * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(gap)
    return gap <= algo.rejection_threshold
