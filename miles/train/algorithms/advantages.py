"""Advantage estimators: one score per sample in, one advantage per sample out.

Signature (built-ins and `pkg.mod:fn` alike): `estimator(scores, groups, lengths) -> advantages`, all shape [N];
`remax` alone takes `(scores, baselines)`, the rewards of greedy responses generated with the rollout.
`scores` are the samples' rewards after shaping (failed samples are already left out), float64; `groups` holds each
sample's prompt group as any integer ids; `lengths` each sample's trained tokens (its loss mask's ones), float64.
The trainer broadcasts each advantage over its sample's response tokens.

Conventions, written down once:
- std is the unbiased one (divisor n - 1), per group for GRPO, over the batch's tokens for REINFORCE++ (n the
  tokens), over its samples for reinforce_plus_plus_sample and reinforce_plus_plus_baseline; a set of one has std 0.
- eps = 1e-6 is added to the std, outside the square root: (r - mean) / (std + eps).
- A group of one sample (the others of its prompt failed, or n_samples_per_prompt = 1) has no baseline: grpo,
  dr_grpo, rloo, opo, gpg and reinforce_plus_plus_baseline give it advantage 0. reinforce_plus_plus and
  reinforce_plus_plus_sample ignore groups.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def _group_means(scores: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's group mean and group size."""
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=scores.dtype, device=scores.device).index_add_(0, inverse, scores)
    return (sums / counts)[inverse], counts[inverse].to(scores.dtype)


def _batch_normalized(values: torch.Tensor) -> torch.Tensor:
    if len(values) < 2:
        return torch.zeros_like(values)
    return (values - values.mean()) / (values.std(unbiased=True) + EPS)


def grpo(scores: torch.Tensor, groups: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + eps) over the samples g of the same prompt.

    Shao et al. 2024, DeepSeekMath (arXiv:2402.03300), section 4.1.2, outcome supervision. Zero-mean per group.
    """
    means, counts = _group_means(scores, groups)
    centred = scores - means
    squares, _ = _group_means(centred**2, groups)
    std = torch.sqrt(torch.where(counts > 1, squares * counts / (counts - 1).clamp(min=1), 0.0))
    return centred / (std + EPS)


def dr_grpo(scores: torch.Tensor, groups: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean_g r: GRPO without the std division, whose per-question weighting is biased.

    Liu et al. 2025, Understanding R1-Zero-Like Training: A Critical Perspective (arXiv:2503.20783), section 3.2;
    used with the seq_mean_token_sum_norm aggregation (its default), which removes the length bias too.
    Zero-mean per group.
    """
    means, _ = _group_means(scores, groups)
    return scores - means


def rloo(scores: torch.Tensor, groups: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean of the other k - 1 samples of the group = k / (k - 1) (r_i - mean_g r).

    Kool et al. 2019, Buy 4 REINFORCE Samples, Get a Baseline for Free!; Ahmadian et al. 2024, Back to Basics
    (arXiv:2402.14740), eq. 7. Zero-mean per group.
    """
    means, counts = _group_means(scores, groups)
    return torch.where(counts > 1, counts / (counts - 1).clamp(min=1) * (scores - means), 0.0)


def reinforce_plus_plus(scores: torch.Tensor, groups: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A_i = (r_i - mean_T r) / (std_T r + eps) over the batch's trained tokens T (each sample's score counts once per
    token it trained): global advantage whitening over tokens, no per-prompt baseline.

    Hu 2025, REINFORCE++ (arXiv:2501.03262), global advantage normalisation, as the paper writes it: a long response
    weighs more in the mean and std. With kl_in_reward the per-token KL penalty is added after this, unwhitened.
    Zero-mean over the batch's tokens.
    """
    tokens = lengths.sum()
    if tokens < 2:
        return torch.zeros_like(scores)
    mean = (lengths * scores).sum() / tokens
    std = torch.sqrt((lengths * (scores - mean) ** 2).sum() / (tokens - 1))
    return (scores - mean) / (std + EPS)


def reinforce_plus_plus_sample(scores: torch.Tensor, groups: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A_i = (r_i - mean_B r) / (std_B r + eps) over the batch's samples B: REINFORCE++ with each sample counted once,
    whatever its length (this project's reinforce_plus_plus before token-level whitening).

    Hu 2025, REINFORCE++ (arXiv:2501.03262), normalised per sample instead of per token. Zero-mean over the batch.
    """
    return _batch_normalized(scores)


def reinforce_plus_plus_baseline(scores: torch.Tensor, groups: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A_i = normalise_B(r_i - mean_g r): the group mean as baseline, then global batch normalisation.

    Hu 2025, REINFORCE++ (arXiv:2501.03262), the REINFORCE++-baseline variant for reasoning tasks. Zero-mean over
    the batch; a group whose scores are all equal gets 0.
    """
    means, _ = _group_means(scores, groups)
    return _batch_normalized(scores - means)


def gpg(scores: torch.Tensor, groups: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A_i = alpha (r_i - mean_g r), alpha = N / M: the group-centred score without a std division, scaled up by the
    share of samples that carry a gradient (M of the N have a nonzero centred score; the others' groups scored
    alike), so that a batch of mostly equal groups still takes a full step.

    Chu et al. 2025, GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning (arXiv:2504.02546),
    the accurate gradient estimation; used with the `gpg` policy loss. (verl counts the samples with a nonzero score
    as M instead.) Zero-mean per group; all zeros when every group scored alike.
    """
    means, _ = _group_means(scores, groups)
    centred = scores - means
    carrying = int((centred != 0).sum())
    return centred * (len(scores) / carrying) if carrying else centred


def opo(scores: torch.Tensor, groups: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - sum_g l_j r_j / sum_g l_j: the group's length-weighted mean score as baseline, the variance-optimal
    one when the gradient's magnitude grows with the response's length.

    Hao et al. 2025, On-Policy RL with Optimal Reward Baseline (arXiv:2505.23585); no std division. Length-weighted
    zero mean per group.
    """
    weighted, _ = _group_means(lengths * scores, groups)
    total, _ = _group_means(lengths, groups)
    return torch.where(total > 0, scores - weighted / total.clamp(min=EPS), 0.0)


def remax(scores: torch.Tensor, baselines: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - r(greedy response to the same prompt): the reward of the prompt's greedy response as the baseline.
    Takes each sample's baseline (`baseline_reward`, generated with the rollout) in place of groups and lengths; a
    sample whose baseline is NaN (its greedy response's reward failed) gets advantage 0.

    Li et al. 2023, ReMax (arXiv:2310.10505), Algorithm 1. No normalisation.
    """
    return torch.where(torch.isnan(baselines), torch.zeros_like(scores), scores - baselines)
