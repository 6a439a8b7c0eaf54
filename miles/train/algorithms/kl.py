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
