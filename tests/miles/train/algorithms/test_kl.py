"""miles.train.algorithms.kl: the k1, k2, k3 and abs estimators on hand values, k3's bounds and gradient."""

from __future__ import annotations

import math

import pytest
import torch

from miles.train.algorithms.kl import (
    K3_LOG_RATIO_LIMIT,
    K3_MAX,
    absolute,
    adaptive_kl_coef,
    k1,
    k1_plus,
    k2,
    k3,
    k3_plus,
)

F64 = torch.float64

# d = log pi_ref - log pi_theta per token: -0.5, 0, 1.0, 2.0
LOGPROBS = torch.tensor([[-1.0, -0.5, -2.0, -3.0]], dtype=F64)
REF_LOGPROBS = torch.tensor([[-1.5, -0.5, -1.0, -1.0]], dtype=F64)


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def test_k1_hand_values():
    # -d: 0.5, 0, -1, -2 (negative where the reference is the likelier)
    torch.testing.assert_close(k1(LOGPROBS, REF_LOGPROBS), _t([[0.5, 0.0, -1.0, -2.0]]))


def test_k2_hand_values():
    # d^2 / 2: 0.25/2, 0, 1/2, 4/2
    torch.testing.assert_close(k2(LOGPROBS, REF_LOGPROBS), _t([[0.125, 0.0, 0.5, 2.0]]))


def test_k2_is_symmetric_half_square():
    # d = 3 and d = -3 both give 9/2
    torch.testing.assert_close(k2(_t([[0.0, -3.0]]), _t([[-3.0, 0.0]])), _t([[4.5, 4.5]]))


def test_k3_hand_values():
    # exp(d) - d - 1: d=-0.5 -> exp(-0.5) + 0.5 - 1; d=0 -> 0; d=1 -> e - 2; d=2 -> e^2 - 3 = 4.389 (under 10)
    expected = _t([[math.exp(-0.5) - 0.5, 0.0, math.e - 2.0, math.exp(2.0) - 3.0]])
    torch.testing.assert_close(k3(LOGPROBS, REF_LOGPROBS), expected)


def test_absolute_hand_values():
    torch.testing.assert_close(absolute(LOGPROBS, REF_LOGPROBS), _t([[0.5, 0.0, 1.0, 2.0]]))


@pytest.mark.parametrize("fn", [k1, k2, k3, absolute], ids=lambda f: f.__name__)
def test_zero_when_equal(fn):
    logprobs = _t([[-0.1, -2.5, -7.0]])
    torch.testing.assert_close(fn(logprobs, logprobs.clone()), torch.zeros(1, 3, dtype=F64))


@pytest.mark.parametrize("fn", [k2, k3, absolute], ids=lambda f: f.__name__)
def test_non_negative(fn):
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(8, 16, generator=gen, dtype=F64) * 6
    ref = -torch.rand(8, 16, generator=gen, dtype=F64) * 6
    out = fn(logprobs, ref)
    assert (out >= 0).all()
    assert (out > 0).any()


def test_k3_clamped_at_k3_max():
    # d = 3: e^3 - 4 = 16.09 -> 10; d = 1000: clamped to 20 first, e^20 - 21 -> 10;
    # d = -1000: clamped to -20, e^-20 + 20 - 1 = 19.0 -> 10
    out = k3(_t([[0.0, 0.0, 0.0]]), _t([[3.0, 1000.0, -1000.0]]))
    assert K3_MAX == 10.0
    torch.testing.assert_close(out, _t([[10.0, 10.0, 10.0]]))


def test_k3_log_ratio_clamp_keeps_it_finite():
    assert K3_LOG_RATIO_LIMIT == 20.0
    logprobs = _t([[0.0, -1e6]]).requires_grad_(True)
    out = k3(logprobs, _t([[-1e6, 0.0]]))
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert torch.isfinite(logprobs.grad).all()


def test_k3_gradient():
    # d k3 / d log pi_theta = -(exp(d) - 1) = 1 - exp(d); at d = -0.5: 1 - exp(-0.5); at d = 1: 1 - e;
    # at d = 3 the estimate is clamped at 10 and has no gradient
    logprobs = _t([[-1.0, -2.0, -3.0]]).requires_grad_(True)
    k3(logprobs, _t([[-1.5, -1.0, 0.0]])).sum().backward()
    torch.testing.assert_close(logprobs.grad, _t([[1 - math.exp(-0.5), 1 - math.e, 0.0]]))


@pytest.mark.parametrize(("straight_through", "value"), [(k1_plus, k1), (k3_plus, k3)], ids=["k1+", "k3+"])
def test_straight_through_variants_have_the_value_of_their_estimator_and_the_gradient_of_k2(straight_through, value):
    logprobs = LOGPROBS.clone().requires_grad_(True)
    estimate = straight_through(logprobs, REF_LOGPROBS)
    torch.testing.assert_close(estimate, value(LOGPROBS, REF_LOGPROBS))
    estimate.sum().backward()
    # d(0.5 (lp - ref)^2)/d lp = lp - ref = -d: 0.5, 0, -1, -2
    torch.testing.assert_close(logprobs.grad, _t([[0.5, 0.0, -1.0, -2.0]]))


def test_adaptive_kl_coef_hand_values():
    # target 0.1, gain 0.1: KL 0.11 -> error 0.1 -> x1.01; KL 0.5 -> error 4, clipped to 0.2 -> x1.02;
    # KL 0.05 -> error -0.5, clipped to -0.2 -> x0.98
    assert adaptive_kl_coef(0.2, [], 0.1, 0.1) == 0.2
    assert adaptive_kl_coef(0.2, [0.11], 0.1, 0.1) == pytest.approx(0.202)
    assert adaptive_kl_coef(0.2, [0.11, 0.5, 0.05], 0.1, 0.1) == pytest.approx(0.2 * 1.01 * 1.02 * 0.98)
