"""KL estimators: per-token estimates of KL(pi_theta || pi_ref) from the sampled tokens' log-probs.

Signature (built-ins and `pkg.mod:fn` alike): `estimator(logprobs, ref_logprobs) -> per_token`, all [B, T]; the
caller masks and aggregates. With d = log pi_ref - log pi_theta on a token sampled from pi_theta (Schulman 2020,
Approximating KL Divergence, http://joschu.net/blog/kl-approx.html):

| name | formula | note |
|---|---|---|
| k1 | -d | unbiased, high variance, can be negative |
| k2 (mse) | d^2 / 2 | biased, low variance, >= 0 |
| k3 (low_var_kl) | exp(d) - d - 1 | unbiased, low variance, >= 0 |
| abs | abs(d) | >= 0 |

k3 clamps d to [-20, 20] before exp and the estimate to at most 10, as verl does, so a token the reference finds
near-impossible cannot dominate the loss.

Straight-through variants `k1+` and `k3+`: the value of k1 or k3 (an unbiased estimate of the KL) with the gradient
of k2, whose expected gradient is the KL's own (k1's and k3's are not): k2 - sg[k2] + sg[k]. verl's `k1+`/`k3+`;
the gradient argument is Schulman 2020 (above) and Tang & Munos 2025, On a Few Pitfalls in KL Divergence Gradient
Estimation for RL.
"""

from __future__ import annotations

import torch

K3_LOG_RATIO_LIMIT = 20.0
K3_MAX = 10.0


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    delta = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_LIMIT, K3_LOG_RATIO_LIMIT)
    return (torch.exp(delta) - delta - 1.0).clamp(max=K3_MAX)


def absolute(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs - ref_logprobs).abs()


def _straight_through(value: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    gradient = k2(logprobs, ref_logprobs)
    return gradient - gradient.detach() + value.detach()


def k1_plus(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return _straight_through(k1(logprobs, ref_logprobs), logprobs, ref_logprobs)


def k3_plus(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return _straight_through(k3(logprobs, ref_logprobs), logprobs, ref_logprobs)


KL_CONTROL_ERROR_LIMIT = 0.2


def adaptive_kl_coef(initial: float, history: list[float], target: float, gain: float) -> float:
    """The KL-in-reward coefficient after the rollouts whose measured KLs are `history`, in order: each multiplies it
    by 1 + gain * clip(KL / target - 1, -0.2, 0.2), raising it while the policy drifts faster than the target.

    Ziegler et al. 2019, Fine-Tuning Language Models from Human Preferences (arXiv:1909.08593), section 2.2: a
    proportional controller with K_beta = gain (the paper's 0.1), one update per rollout.
    """
    coef = initial
    for kl in history:
        coef *= 1.0 + gain * min(max(kl / target - 1.0, -KL_CONTROL_ERROR_LIMIT), KL_CONTROL_ERROR_LIMIT)
    return coef
