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
