"""miles.train.algorithms.value: GAE, whitening and the clipped value loss on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from miles.train.algorithms.value import gae, value_loss, whiten

F64 = torch.float64


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


REWARDS = _t([[0.0, 0.0, 1.0]])
VALUES = _t([[0.5, 0.6, 0.7]])


def test_gae_hand_values():
    # gamma 0.9, lam 0.8 (gamma lam = 0.72):
    # delta_2 = 1 - 0.7 = 0.3                     A_2 = 0.3
    # delta_1 = 0.9 * 0.7 - 0.6 = 0.03            A_1 = 0.03 + 0.72 * 0.3 = 0.246
    # delta_0 = 0.9 * 0.6 - 0.5 = 0.04            A_0 = 0.04 + 0.72 * 0.246 = 0.21712
    advantages, returns = gae(REWARDS, VALUES, torch.ones(1, 3), gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, _t([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(returns, _t([[0.71712, 0.846, 1.0]]))


def test_gae_with_gamma_and_lam_one_is_the_return_to_go_minus_the_value():
    advantages, returns = gae(REWARDS, VALUES, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, _t([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(returns, _t([[1.0, 1.0, 1.0]]))


def test_gae_skips_the_tokens_outside_the_mask():
    # The middle token is the environment's: token 0's next value is token 2's.
    # delta_2 = 0.3, A_2 = 0.3; delta_0 = 0.9 * 0.7 - 0.5 = 0.13, A_0 = 0.13 + 0.72 * 0.3 = 0.346
    advantages, returns = gae(REWARDS, VALUES, _t([[1, 0, 1]]), gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, _t([[0.346, 0.0, 0.3]]))
    torch.testing.assert_close(returns, _t([[0.846, 0.0, 1.0]]))


def test_gae_ends_each_response_at_its_last_trained_token():
    # Row 1 is a 2-token response padded to 3: its last trained token bootstraps from 0, not from the padding.
    rewards = _t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = _t([[0.5, 0.6, 0.7], [1.0, 1.0, 9.0]])
    advantages, _ = gae(rewards, values, _t([[1, 1, 1], [1, 1, 0]]), gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages[1], _t([1.0, 1.0, 0.0]))  # 2 - 1 at both tokens


def test_whiten_hand_values():
    # trained values 1, 2, 3 (the 10 is outside the mask): mean 2, unbiased variance 1
    out = whiten(_t([[1.0, 2.0], [3.0, 10.0]]), _t([[1, 1], [1, 0]]))
    scale = 1 / math.sqrt(1 + 1e-8)
    torch.testing.assert_close(out, _t([[-scale, 0.0], [scale, 0.0]]))


def test_value_loss_hand_values_and_gradient():
    # clip 0.2 around V_old = 0.5: V 0.9 -> 0.7. R = 1: unclipped 0.01, clipped 0.09 -> clipped wins (no gradient).
    # V 0.6 (inside the range), R = 1: 0.16 both ways. R = 0.5, V 0.9: unclipped 0.16 > clipped 0.04.
    predicted = _t([[0.9, 0.6, 0.9]]).requires_grad_(True)
    loss, clipped = value_loss(predicted, _t([[0.5, 0.5, 0.5]]), _t([[1.0, 1.0, 0.5]]), clip=0.2)
    torch.testing.assert_close(loss, _t([[0.045, 0.08, 0.08]]))
    assert clipped.tolist() == [[True, False, False]]
    loss.sum().backward()
    torch.testing.assert_close(predicted.grad, _t([[0.0, -0.4, 0.4]]))  # V - R where unclipped


def test_value_loss_without_clip_is_half_the_squared_error():
    loss, clipped = value_loss(_t([[0.9]]), _t([[0.0]]), _t([[1.0]]), clip=None)
    assert loss.item() == pytest.approx(0.005) and not clipped.any()
