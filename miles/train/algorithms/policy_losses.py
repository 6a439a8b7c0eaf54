"""Policy losses: per-token loss terms over a [B, T] token grid, to be summed by the loss aggregation.

Signature (built-ins and `pkg.mod:fn` alike): `loss(logprobs, old_logprobs, advantages, mask, algo) -> (per_token,
clipped)`. `logprobs` carries the gradient; `old_logprobs` (the policy that the rollout is corrected to: the trainer's
recompute, or the engine's log-probs with `algo.use_rollout_logprobs`) and `advantages` do not; all are [B, T], and
`mask` marks the trained response tokens. `per_token` is the loss of each token ([B, T]); `clipped` marks the tokens
a clip acted on ([B, T] bool, for the clip_fraction metric). `algo` is the run's AlgoConfig.

Numerical safety: every log-ratio is clamped to [-20, 20] before exp (LOG_RATIO_LIMIT), so a token whose policies
disagree wildly gives a large finite ratio that the clip then handles, never inf or nan.
"""

from __future__ import annotations

import torch

LOG_RATIO_LIMIT = 20.0


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _upper_eps(algo) -> float:
    return algo.eps_clip if algo.eps_clip_high is None else algo.eps_clip_high


def ppo_clip(logprobs, old_logprobs, advantages, mask, algo) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high)) with r = pi_theta / pi_old per token.

    Schulman et al. 2017, PPO (arXiv:1707.06347), eq. 7, written as a loss; the separate upper bound is DAPO's
    clip-higher (Yu et al. 2025, arXiv:2503.14476, section 3.1). With `algo.clip_ratio_c` = c, dual clip (Ye et al.
    2020, Mastering Complex Control in MOBA Games with Deep RL, arXiv:1912.09729, eq. 5) caps a negative-advantage
    token's loss at -c A, so a huge ratio cannot blow up the step; that token then has no gradient. A token whose
    ratio is clipped on the side that wins the max has no gradient either.
    """
    ratio = _ratio(logprobs - old_logprobs)
    loss, clipped = _clipped_surrogate(ratio, advantages, algo.eps_clip, _upper_eps(algo))
    if algo.clip_ratio_c is not None:
        cap = -advantages * algo.clip_ratio_c
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        clipped = clipped | capped
    return loss, clipped


def gspo(logprobs, old_logprobs, advantages, mask, algo) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate on the sequence-level ratio s_i = exp(mean over the response of log(pi_theta / pi_old)),
    the geometric mean of the token ratios.

    Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071), eq. 5-7, in its GSPO-token form
    (eq. 13): s_i,t = sg[s_i] pi_theta(y_t) / sg[pi_theta(y_t)] has the value s_i and the gradient s_i grad log
    pi_theta(y_t), so under the seq_mean_token_mean aggregation (gspo's default) this is GSPO's gradient exactly.
    Clipping acts on whole sequences; the paper's ranges are small (eps_clip=3e-4, eps_clip_high=4e-4).
    """
    lengths = mask.sum(dim=1).clamp(min=1)
    sequence_log_ratio = ((logprobs - old_logprobs) * mask).sum(dim=1) / lengths
    log_ratio = logprobs - logprobs.detach() + sequence_log_ratio.detach().unsqueeze(1)
    return _clipped_surrogate(_ratio(log_ratio), advantages, algo.eps_clip, _upper_eps(algo))


def cispo(logprobs, old_logprobs, advantages, mask, algo) -> tuple[torch.Tensor, torch.Tensor]:
    """-sg[clip(r, 1 - eps_clip, 1 + eps_clip_high)] A log pi_theta: REINFORCE with a clipped, stop-gradient
    importance weight.

    MiniMax 2025, MiniMax-M1 (arXiv:2506.13585), eq. 4-5. Unlike PPO's clip, a clipped token keeps its gradient
    (only its weight is bounded). M1 sets no lower bound in effect: eps_clip=1 gives a weight floor of 0.
    """
    ratio = _ratio(logprobs.detach() - old_logprobs)
    weight = ratio.clamp(1.0 - algo.eps_clip, 1.0 + _upper_eps(algo))
    return -weight * advantages * logprobs, weight != ratio


def _no_clip(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(mask, dtype=torch.bool)


def gpg(logprobs, old_logprobs, advantages, mask, algo) -> tuple[torch.Tensor, torch.Tensor]:
    """-A log pi_theta: the plain policy gradient, no ratio and no clip (on-policy by construction; the TIS weight,
    when on, still corrects for the engine).

    Chu et al. 2025, GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning (arXiv:2504.02546).
    """
    return -advantages * logprobs, _no_clip(mask)


def geo_mean(logprobs, old_logprobs, advantages, mask, algo) -> tuple[torch.Tensor, torch.Tensor]:
    """-A_i prod_t min(r_t, clip(r_t))^(1/|y_i|) over a response: GMPO's geometric mean of the token ratios, each
    clipped in log space to [-eps_clip, eps_clip_high] on the pessimistic side of its advantage's sign.

    Geometric-Mean Policy Optimization (GMPO, arXiv:2507.20673); the paper's wider range is
    eps_clip = eps_clip_high = 0.4. The advantage is the sequence's mean over its tokens (sequence-level advantages).
    Each token carries its sequence's loss, so the default aggregation, seq_mean_token_mean, gives the paper's
    mean over sequences. A token clipped on the side that counts has no gradient.
    """
    log_ratio = logprobs - old_logprobs
    sign = torch.sign(advantages)
    bounded = log_ratio.clamp(-algo.eps_clip, _upper_eps(algo))
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    lengths = mask.sum(dim=1).clamp(min=1)
    sequence_ratio = _ratio((pessimistic * mask).sum(dim=1) / lengths)
    sequence_advantage = (advantages * mask).sum(dim=1) / lengths
    loss = -(sequence_advantage * sequence_ratio).unsqueeze(1).expand_as(logprobs)
    return loss, (pessimistic != log_ratio) & mask.bool()


def sapo(logprobs, old_logprobs, advantages, mask, algo) -> tuple[torch.Tensor, torch.Tensor]:
    """-f(r) A with the soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau instead of a hard clip: its gradient is that of
    -r A at r = 1 and fades smoothly as r leaves 1; tau = sapo_tau_pos where A > 0, sapo_tau_neg otherwise (a
    negative token's gradient fades faster).

    Soft Adaptive Policy Optimization (SAPO, arXiv:2511.20347); defaults tau_pos = 1.0, tau_neg = 1.05 and the
    seq_mean_token_mean aggregation, as the paper's.
    """
    ratio = _ratio(logprobs - old_logprobs)
    tau = torch.where(advantages > 0, algo.sapo_tau_pos, algo.sapo_tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * advantages, _no_clip(mask)


def _covariance(logprobs: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each trained token's centred product (A - mean A)(log pi - mean log pi) over the micro-batch's trained tokens."""
    logprobs = logprobs.detach()
    count = valid.sum().clamp(min=1)
    centred_advantages = advantages - (advantages * valid).sum() / count
    centred_logprobs = logprobs - (logprobs * valid).sum() / count
    return centred_advantages * centred_logprobs


def clip_cov(logprobs, old_logprobs, advantages, mask, algo) -> tuple[torch.Tensor, torch.Tensor]:
    """ppo_clip, with the gradient cut from a random clip_cov_ratio of the trained tokens (at least one) whose
    covariance (A - mean A)(log pi - mean log pi) lies in (clip_cov_lb, clip_cov_ub) and that the clip left alone:
    those tokens drive the entropy collapse.

    Cui et al. 2025, The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models
    (arXiv:2505.22617), section 4, Clip-Cov. The pick draws on torch's generator, which the trainer seeds per rollout;
    the covariance is over the micro-batch, as the paper's code. A cut token counts as clipped.
    """
    loss, clipped = ppo_clip(logprobs, old_logprobs, advantages, mask, algo)
    valid = mask.bool()
    covariance = _covariance(logprobs, advantages, valid)
    candidates = (valid & ~clipped & (covariance > algo.clip_cov_lb) & (covariance < algo.clip_cov_ub)).nonzero()
    count = max(int(algo.clip_cov_ratio * int(valid.sum())), 1)
    chosen = candidates[torch.randperm(len(candidates))[:count]]
    cut = torch.zeros_like(valid)
    cut[chosen[:, 0], chosen[:, 1]] = True
    return torch.where(cut, 0.0, loss), clipped | cut


def kl_cov(logprobs, old_logprobs, advantages, mask, algo) -> tuple[torch.Tensor, torch.Tensor]:
    """-A r on every token, plus kl_cov_coef |log r| on the kl_cov_ratio of trained tokens (at least one) with the
    largest covariance (A - mean A)(log pi - mean log pi): a KL penalty where the entropy collapses, no clip.

    Cui et al. 2025, The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models
    (arXiv:2505.22617), section 4, KL-Cov; the covariance is over the micro-batch, as the paper's code. A penalised
    token counts as clipped.
    """
    log_ratio = logprobs - old_logprobs
    loss = -advantages * _ratio(log_ratio)
    valid = mask.bool()
    positions = valid.nonzero()
    count = max(int(algo.kl_cov_ratio * len(positions)), 1)
    largest = torch.topk(_covariance(logprobs, advantages, valid)[valid], min(count, len(positions))).indices
    penalised = torch.zeros_like(valid)
    penalised[positions[largest, 0], positions[largest, 1]] = True
    return torch.where(penalised, loss + algo.kl_cov_coef * log_ratio.abs(), loss), penalised
