"""miles.train.algorithms.policy_losses: ppo_clip, gspo and cispo values, clip masks and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from miles.config import AlgoConfig
from miles.train.algorithms.aggregation import LossScale, seq_mean_token_mean
from miles.train.algorithms.policy_losses import (
    LOG_RATIO_LIMIT,
    cispo,
    clip_cov,
    geo_mean,
    gpg,
    gspo,
    kl_cov,
    ppo_clip,
    sapo,
)

F64 = torch.float64
ALGO = AlgoConfig(eps_clip=0.2, eps_clip_high=0.3)  # ratio bounds [0.8, 1.3]


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _inputs(ratios, advantages, old=None):
    """(logprobs with grad, old_logprobs, advantages, mask) with logprobs - old_logprobs = log(ratio)."""
    ratios = _t(ratios)
    old = torch.full_like(ratios, -1.0) if old is None else _t(old)
    logprobs = (old + ratios.log()).requires_grad_(True)
    return logprobs, old, _t(advantages), torch.ones_like(ratios)


# ---- ppo_clip -----------------------------------------------------------------------------------------------------

# Each token's (advantage, ratio), chosen to hit every branch of the clipped surrogate with bounds [0.8, 1.3].
PPO_RATIOS = [[1.1, 1.5, 0.5, 1.0], [0.5, 1.5, 5.0, 5.0]]
PPO_ADVANTAGES = [[1.0, 1.0, 1.0, 0.5], [-1.0, -1.0, -2.0, 2.0]]


def test_ppo_clip_hand_values():
    loss, clipped = ppo_clip(*_inputs(PPO_RATIOS, PPO_ADVANTAGES), ALGO)
    expected = _t(
        [
            # A=1 r=1.1: in range, -1.1
            # A=1 r=1.5: max(-1.5, -1*1.3) = -1.3, clip wins
            # A=1 r=0.5: max(-0.5, -1*0.8) = -0.5, unclipped wins
            # A=0.5 r=1: -0.5
            [-1.1, -1.3, -0.5, -0.5],
            # A=-1 r=0.5: max(0.5, 0.8) = 0.8, clip wins
            # A=-1 r=1.5: max(1.5, 1.3) = 1.5, unclipped wins
            # A=-2 r=5: max(10, 2*1.3=2.6) = 10, unclipped wins (no dual clip)
            # A=2 r=5: max(-10, -2*1.3=-2.6) = -2.6, clip wins
            [0.8, 1.5, 10.0, -2.6],
        ]
    )
    torch.testing.assert_close(loss, expected)
    assert clipped.tolist() == [[False, True, False, False], [True, False, False, True]]


def test_ppo_clip_gradient_is_zero_where_the_clip_wins():
    logprobs, old, adv, mask = _inputs(PPO_RATIOS, PPO_ADVANTAGES)
    loss, _ = ppo_clip(logprobs, old, adv, mask, ALGO)
    loss.sum().backward()
    # unclipped token: d(-A r)/d logprob = -A r; clipped (winning side): 0
    expected = _t(
        [
            [-1.1, 0.0, -0.5, -0.5],  # -1*1.1, clipped, -1*0.5, -0.5*1
            [0.0, 1.5, 10.0, 0.0],  # clipped, -(-1)*1.5, -(-2)*5, clipped
        ]
    )
    torch.testing.assert_close(logprobs.grad, expected)


def test_ppo_clip_symmetric_without_eps_clip_high():
    algo = AlgoConfig(eps_clip=0.2)  # bounds [0.8, 1.2]
    loss, clipped = ppo_clip(*_inputs([[1.5, 1.5, 1.1]], [[1.0, -1.0, 1.0]]), algo)
    # A=1 r=1.5: max(-1.5, -1.2) = -1.2 clipped; A=-1 r=1.5: max(1.5, 1.2) = 1.5; A=1 r=1.1: -1.1
    torch.testing.assert_close(loss, _t([[-1.2, 1.5, -1.1]]))
    assert clipped.tolist() == [[True, False, False]]


def test_ppo_clip_dual_clip_caps_negative_advantages():
    algo = AlgoConfig(eps_clip=0.2, eps_clip_high=0.3, clip_ratio_c=3.0)
    logprobs, old, adv, mask = _inputs(PPO_RATIOS, PPO_ADVANTAGES)
    loss, clipped = ppo_clip(logprobs, old, adv, mask, algo)
    # Only A=-2 r=5 changes: its loss 10 exceeds the cap -A c = 2*3 = 6, so it becomes 6. The other negative-advantage
    # tokens stay under their caps (0.8 < 3, 1.5 < 3); the positive A=2 r=5 token is not touched by the dual clip.
    expected = _t([[-1.1, -1.3, -0.5, -0.5], [0.8, 1.5, 6.0, -2.6]])
    torch.testing.assert_close(loss, expected)
    assert clipped.tolist() == [[False, True, False, False], [True, False, True, True]]
    loss.sum().backward()
    # the dual-clipped token has no gradient; the others are as without the dual clip
    torch.testing.assert_close(logprobs.grad, _t([[-1.1, 0.0, -0.5, -0.5], [0.0, 1.5, 0.0, 0.0]]))


def test_ppo_clip_dual_clip_leaves_a_loss_below_the_cap():
    algo = AlgoConfig(eps_clip=0.2, clip_ratio_c=3.0)
    logprobs, old, adv, mask = _inputs([[2.9]], [[-1.0]])
    loss, clipped = ppo_clip(logprobs, old, adv, mask, algo)
    # A=-1 r=2.9: max(2.9, 1.2) = 2.9 < cap 3: unchanged, gradient -A r = 2.9
    torch.testing.assert_close(loss, _t([[2.9]]))
    assert not clipped.any()
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, _t([[2.9]]))


# ---- gspo ---------------------------------------------------------------------------------------------------------

GSPO_MASK = [[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]]
# log(pi_theta / pi_old) per token; the masked-out tokens carry large values that must not count
GSPO_LOG_RATIOS = [[0.1, 0.3, 5.0], [0.6, 0.3, 0.0], [-0.9, -0.3, -7.0], [0.4, -0.2, 0.1]]
GSPO_ADVANTAGES = [1.0, 1.0, -1.0, -2.0]


def _gspo_inputs():
    log_ratios = _t(GSPO_LOG_RATIOS)
    old = _t([[-1.0, -1.5, -2.0]] * 4)
    logprobs = (old + log_ratios).requires_grad_(True)
    advantages = _t(GSPO_ADVANTAGES).unsqueeze(1).expand(4, 3)
    return logprobs, old, advantages, _t(GSPO_MASK)


def test_gspo_hand_values():
    loss, clipped = gspo(*_gspo_inputs(), ALGO)
    # seq 0: mean(0.1, 0.3) = 0.2, s = exp(0.2) = 1.2214 in [0.8, 1.3], A=1: -exp(0.2) on every token.
    #        (its token 1 alone, ratio exp(0.3) = 1.35, would be clipped by a per-token PPO: here it is not)
    # seq 1: mean(0.6, 0.3, 0.0) = 0.3, s = exp(0.3) = 1.3499 > 1.3, A=1: max(-1.3499, -1.3) = -1.3, clipped.
    #        (its token 2, ratio 1, is in range but clipped with its sequence)
    # seq 2: mean(-0.9, -0.3) = -0.6, s = exp(-0.6) = 0.5488 < 0.8, A=-1: max(0.5488, 0.8) = 0.8, clipped.
    # seq 3: mean(0.4, -0.2, 0.1) = 0.1, s = exp(0.1), A=-2: max(2 exp(0.1), 2*1.1052 clip no-op) = 2 exp(0.1).
    expected = _t(
        [
            [-math.exp(0.2)] * 3,
            [-1.3] * 3,
            [0.8] * 3,
            [2 * math.exp(0.1)] * 3,
        ]
    )
    torch.testing.assert_close(loss, expected)
    assert clipped.tolist() == [[False] * 3, [True] * 3, [True] * 3, [False] * 3]


def test_gspo_ratio_ignores_masked_out_tokens():
    logprobs, old, adv, mask = _gspo_inputs()
    changed = logprobs.detach().clone()
    changed[0, 2] += 100.0  # a masked-out token
    loss_a, _ = gspo(logprobs, old, adv, mask, ALGO)
    loss_b, _ = gspo(changed, old, adv, mask, ALGO)
    torch.testing.assert_close(loss_a, loss_b)


def test_gspo_gradient_matches_the_sequence_level_gradient():
    logprobs, old, adv, mask = _gspo_inputs()
    loss, _ = gspo(logprobs, old, adv, mask, ALGO)
    seq_mean_token_mean(loss, mask, LossScale(tokens=10.0, sequences=4, horizon=3)).backward()
    # J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i), d s_i / d log pi(y_t) = s_i / |y_i|, G = 4:
    # d loss / d logprob_it = -(1/4) A_i s_i / |y_i| on the response tokens of an unclipped sequence, else 0.
    # seq 0: -(1/4)(1)(exp 0.2)/2 = -exp(0.2)/8 on tokens 0, 1; token 2 is masked out.
    # seq 1, seq 2: clipped, 0 on every token.
    # seq 3: -(1/4)(-2)(exp 0.1)/3 = exp(0.1)/6 on all three tokens.
    g0 = -math.exp(0.2) / 8
    g3 = math.exp(0.1) / 6
    expected = _t([[g0, g0, 0.0], [0.0] * 3, [0.0] * 3, [g3] * 3])
    torch.testing.assert_close(logprobs.grad, expected)


def test_gspo_empty_response_has_ratio_one():
    # no trained token: the mean log-ratio is 0/1, s = 1, loss -A
    logprobs = _t([[-1.0, -2.0]]).requires_grad_(True)
    loss, clipped = gspo(logprobs, _t([[-3.0, -0.5]]), _t([[2.0, 2.0]]), _t([[0, 0]]), ALGO)
    torch.testing.assert_close(loss, _t([[-2.0, -2.0]]))
    assert not clipped.any()


# ---- cispo --------------------------------------------------------------------------------------------------------

CISPO_LOGPROBS = [[-0.5, -1.0, -0.2, -2.0]]
CISPO_RATIOS = [1.5, 1.1, 0.5, 0.9]
CISPO_ADVANTAGES = [[1.0, 2.0, -1.0, -0.5]]


def _cispo_inputs():
    logprobs = _t(CISPO_LOGPROBS).requires_grad_(True)
    old = _t(CISPO_LOGPROBS) - _t([CISPO_RATIOS]).log()
    return logprobs, old, _t(CISPO_ADVANTAGES), torch.ones(1, 4, dtype=F64)


def test_cispo_hand_values():
    loss, clipped = cispo(*_cispo_inputs(), ALGO)
    # loss = -w A log pi with w = clip(r, 0.8, 1.3):
    # r=1.5 -> w=1.3, A=1,    logp=-0.5: -1.3*1*(-0.5)     = 0.65, clipped
    # r=1.1 -> w=1.1, A=2,    logp=-1.0: -1.1*2*(-1.0)     = 2.2
    # r=0.5 -> w=0.8, A=-1,   logp=-0.2: -0.8*(-1)*(-0.2)  = -0.16, clipped
    # r=0.9 -> w=0.9, A=-0.5, logp=-2.0: -0.9*(-0.5)*(-2)  = -0.9
    torch.testing.assert_close(loss, _t([[0.65, 2.2, -0.16, -0.9]]))
    assert clipped.tolist() == [[True, False, True, False]]


def test_cispo_clipped_tokens_keep_their_gradient():
    logprobs, old, adv, mask = _cispo_inputs()
    loss, _ = cispo(logprobs, old, adv, mask, ALGO)
    loss.sum().backward()
    # d/d logp of -sg[w] A logp = -w A: r=1.5 -> -1.3, r=1.1 -> -2.2, r=0.5 -> 0.8, r=0.9 -> 0.45.
    # (A weight with a gradient would add -A logp r: for the second token -2*(-1)*1.1 = 2.2, a total of 0.)
    torch.testing.assert_close(logprobs.grad, _t([[-1.3, -2.2, 0.8, 0.45]]))


def test_cispo_eps_clip_one_has_no_lower_bound_in_effect():
    algo = AlgoConfig(eps_clip=1.0, eps_clip_high=0.3)  # weight in [0, 1.3]
    logprobs, old, adv, mask = _inputs([[0.01]], [[1.0]], old=[[-3.0 - math.log(0.01)]])
    loss, clipped = cispo(logprobs, old, adv, mask, algo)
    # logp = -3, r = 0.01 kept: -0.01 * 1 * (-3) = 0.03
    torch.testing.assert_close(loss, _t([[0.03]]))
    assert not clipped.any()


# ---- all three ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("log_ratio", [1000.0, -1000.0])
@pytest.mark.parametrize("fn", [ppo_clip, gspo, cispo], ids=lambda f: f.__name__)
def test_huge_log_ratio_stays_finite(fn, log_ratio):
    old = _t([[-1.0, -1.0]])
    logprobs = (old + _t([[log_ratio, 0.0]])).requires_grad_(True)
    advantages = _t([[-1.0, -1.0]])
    mask = _t([[1, 0]])
    loss, clipped = fn(logprobs, old, advantages, mask, ALGO)
    loss.sum().backward()
    assert torch.isfinite(loss).all()
    assert torch.isfinite(logprobs.grad).all()
    if fn is cispo:
        # the weight is clipped: 1.3 above, 0.8 below; loss -w A logp with logp = -1 + log_ratio
        weight = 1.3 if log_ratio > 0 else 0.8
        assert loss[0, 0].item() == pytest.approx(weight * (-1.0 + log_ratio))
    else:
        # A=-1: the ratio exp(+-20) is the clamped one. Above: max(e^20, 1.3) = e^20; below: max(e^-20, 0.8) = 0.8
        expected = math.exp(LOG_RATIO_LIMIT) if log_ratio > 0 else 0.8
        assert loss[0, 0].item() == pytest.approx(expected)
        assert bool(clipped[0, 0]) is (log_ratio < 0)


def test_log_ratio_limit_is_twenty():
    assert LOG_RATIO_LIMIT == 20.0


@pytest.mark.parametrize("fn", [ppo_clip, gspo, cispo], ids=lambda f: f.__name__)
def test_shapes_and_gradient_reaches_logprobs(fn):
    logprobs = _t([[-1.0, -0.5, -0.7], [-0.2, -0.3, -0.4]]).requires_grad_(True)
    old = _t([[-1.1, -0.4, -0.7], [-0.25, -0.3, -0.35]])
    advantages = _t([[0.5] * 3, [-1.0] * 3])
    loss, clipped = fn(logprobs, old, advantages, _t([[1, 1, 1], [1, 1, 0]]), ALGO)
    assert loss.shape == (2, 3) and clipped.shape == (2, 3)
    assert clipped.dtype == torch.bool
    loss.sum().backward()
    assert (logprobs.grad[:, :2] != 0).all()


# ---- gpg, geo_mean, sapo, clip_cov, kl_cov ------------------------------------------------------------------------


def test_gpg_is_the_plain_policy_gradient():
    logprobs = _t([[-1.0, -2.0]]).requires_grad_(True)
    loss, clipped = gpg(logprobs, logprobs.detach() + 5.0, _t([[1.0, -0.5]]), torch.ones(1, 2), ALGO)
    torch.testing.assert_close(loss, _t([[1.0, -1.0]]))  # -A log pi: -1*-1, 0.5*-2; the old policy plays no part
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, _t([[-1.0, 0.5]]))  # -A
    assert not clipped.any()


def test_geo_mean_hand_values_and_gradient():
    # Log-space bounds [-0.2, 0.3]. Row 0, A = 1: log r = [ln 1.5, ln 0.5] -> pessimistic min with the bound:
    # [0.3 (clipped), ln 0.5]; row 1, A = -1: max with the bound: [ln 1.5, -0.2 (clipped)].
    logprobs, old, adv, mask = _inputs([[1.5, 0.5], [1.5, 0.5]], [[1.0, 1.0], [-1.0, -1.0]])
    loss, clipped = geo_mean(logprobs, old, adv, mask, ALGO)
    ratio_0 = math.exp((0.3 + math.log(0.5)) / 2)
    ratio_1 = math.exp((math.log(1.5) - 0.2) / 2)
    torch.testing.assert_close(loss, _t([[-ratio_0, -ratio_0], [ratio_1, ratio_1]]))
    assert clipped.tolist() == [[True, False], [False, True]]
    seq_mean_token_mean(loss, mask, LossScale(tokens=4.0, sequences=2, horizon=2)).backward()
    # d/d lp_t of -A exp(mean_t log r) = -A exp(.) / |y| on an unclipped token, over 2 sequences
    torch.testing.assert_close(logprobs.grad, _t([[0.0, -ratio_0 / 4], [ratio_1 / 4, 0.0]]))
    assert AlgoConfig(policy_loss="geo_mean").aggregation == "seq_mean_token_mean"


def test_sapo_hand_values_and_gradient():
    # A = 1, r = 1, tau+ = 1: f = sigmoid(0) 4 = 2; A = -1, r = e^0.1, tau- = 1.05: f = sigmoid(1.05 (e^0.1 - 1)) 4/1.05
    logprobs, old, adv, mask = _inputs([[1.0, math.exp(0.1)]], [[1.0, -1.0]])
    loss, clipped = sapo(logprobs, old, adv, mask, AlgoConfig())
    gate = 1 / (1 + math.exp(-1.05 * (math.exp(0.1) - 1)))
    torch.testing.assert_close(loss, _t([[-2.0, gate * 4 / 1.05]]))
    assert not clipped.any()
    loss.sum().backward()
    # d/d lp (-A f(r)) = -A 4 sigmoid (1 - sigmoid) r: -1 at r = 1 (PPO's gradient), a softer one off it
    torch.testing.assert_close(logprobs.grad, _t([[-1.0, 4 * gate * (1 - gate) * math.exp(0.1)]]))
    assert AlgoConfig(policy_loss="sapo").aggregation == "seq_mean_token_mean"


# log pi [[-1, -3], [-1.5, -2.5]] (mean -2), A [[1, 1], [-1, -1]] (mean 0): covariance (A - 0)(log pi + 2) =
# [[1, -1], [-0.5, 0.5]].
COV_LOGPROBS = [[-1.0, -3.0], [-1.5, -2.5]]
COV_ADVANTAGES = [[1.0, 1.0], [-1.0, -1.0]]


def _cov_inputs(ratios):
    logprobs = _t(COV_LOGPROBS).requires_grad_(True)
    return logprobs, logprobs.detach() - _t(ratios).log(), _t(COV_ADVANTAGES), torch.ones(2, 2)


def test_clip_cov_cuts_the_gradient_of_a_high_covariance_token_the_clip_left_alone():
    # Covariances in (0.4, 5): (0, 0) at 1 and (1, 1) at 0.5; (1, 1) has A = -1, r = 0.5, which the clip takes
    # (max(0.5, 0.8)), so (0, 0) is the only candidate and the ratio's share (at least one token) cuts it.
    algo = AlgoConfig(eps_clip=0.2, eps_clip_high=0.3, clip_cov_lb=0.4)
    logprobs, old, adv, mask = _cov_inputs([[1.1, 1.0], [1.0, 0.5]])
    loss, clipped = clip_cov(logprobs, old, adv, mask, algo)
    torch.testing.assert_close(loss, _t([[0.0, -1.0], [1.0, 0.8]]))
    assert clipped.tolist() == [[True, False], [False, True]]
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, _t([[0.0, -1.0], [1.0, 0.0]]))


def test_kl_cov_penalises_the_largest_covariance_token():
    # The largest covariance is (0, 0), r = 1.2: -1.2 + |ln 1.2|; the others -A r, no clip (r = 1.5 stays 1.5).
    algo = AlgoConfig(kl_cov_coef=2.0)
    logprobs, old, adv, mask = _cov_inputs([[1.2, 1.5], [1.0, 1.0]])
    loss, penalised = kl_cov(logprobs, old, adv, mask, algo)
    torch.testing.assert_close(loss, _t([[-1.2 + 2.0 * math.log(1.2), -1.5], [1.0, 1.0]]))
    assert penalised.tolist() == [[True, False], [False, False]]
    loss.sum().backward()
    # d/d lp (-A r + c |log r|) = -A r + c sign(log r)
    torch.testing.assert_close(logprobs.grad, _t([[-1.2 + 2.0, -1.5], [1.0, 1.0]]))
