"""miles.train.algorithms.off_policy: importance_weights (token and sequence level, clamp and mask modes) and
kept_by_rejection (each gap estimator, token and sequence level)."""

from __future__ import annotations

import math

import pytest
import torch

from miles.config import AlgoConfig
from miles.train.algorithms.off_policy import importance_weights, kept_by_rejection

F64 = torch.float64


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _token_inputs():
    # pi_old / pi_rollout per token: 3, 0.5, 1, 1.5 (bounds below: [0.6, 2])
    rollout = _t([[-1.0, -2.0, -0.5, -3.0]])
    old = rollout + _t([[math.log(3.0), math.log(0.5), 0.0, math.log(1.5)]])
    return old, rollout, torch.ones(1, 4, dtype=F64)


def test_token_clamp():
    algo = AlgoConfig(tis_level="token", tis_mode="clamp", tis_clip=2.0, tis_clip_low=0.6)
    weights, changed = importance_weights(*_token_inputs(), algo)
    # 3 -> 2 (upper bound), 0.5 -> 0.6 (lower bound), 1 and 1.5 kept
    torch.testing.assert_close(weights, _t([[2.0, 0.6, 1.0, 1.5]]))
    assert changed.tolist() == [[True, True, False, False]]


def test_token_mask():
    algo = AlgoConfig(tis_level="token", tis_mode="mask", tis_clip=2.0, tis_clip_low=0.6)
    weights, changed = importance_weights(*_token_inputs(), algo)
    # 3 and 0.5 are outside [0.6, 2]: 0; 1 and 1.5 kept
    torch.testing.assert_close(weights, _t([[0.0, 0.0, 1.0, 1.5]]))
    assert changed.tolist() == [[True, True, False, False]]


def test_default_lower_bound_is_zero():
    algo = AlgoConfig(tis_clip=2.0)  # token, clamp, tis_clip_low 0
    weights, changed = importance_weights(*_token_inputs(), algo)
    # only 3 is out of [0, 2]
    torch.testing.assert_close(weights, _t([[2.0, 0.5, 1.0, 1.5]]))
    assert changed.tolist() == [[True, False, False, False]]


def test_bounds_are_inclusive_in_mask_mode():
    # a ratio of exactly 1 (equal log-probs) on the bounds [1, 1] is kept, not masked
    algo = AlgoConfig(tis_mode="mask", tis_clip=1.0, tis_clip_low=1.0)
    logprobs = _t([[-1.0, -0.25]])
    weights, changed = importance_weights(logprobs, logprobs.clone(), torch.ones(1, 2, dtype=F64), algo)
    torch.testing.assert_close(weights, _t([[1.0, 1.0]]))
    assert not changed.any()


SEQ_MASK = [[1, 1, 0], [1, 1, 1], [1, 1, 1]]
# log(pi_old / pi_rollout) per token; row 0's masked-out token must not count
SEQ_LOG_RATIOS = [[0.2, 0.3, 5.0], [0.4, 0.5, 0.2], [-0.5, -1.0, 0.1]]


def _sequence_inputs():
    rollout = _t([[-1.0, -2.0, -0.5]] * 3)
    return rollout + _t(SEQ_LOG_RATIOS), rollout, _t(SEQ_MASK)


def test_sequence_clamp():
    algo = AlgoConfig(tis_level="sequence", tis_mode="clamp", tis_clip=2.0, tis_clip_low=0.5)
    weights, changed = importance_weights(*_sequence_inputs(), algo)
    # row 0: exp(0.2 + 0.3) = exp(0.5) = 1.6487 in [0.5, 2], on all three tokens (the masked 5.0 left out)
    # row 1: exp(0.4 + 0.5 + 0.2) = exp(1.1) = 3.004 -> 2 on all tokens
    # row 2: exp(-0.5 - 1.0 + 0.1) = exp(-1.4) = 0.2466 -> 0.5 on all tokens
    expected = _t([[math.exp(0.5)] * 3, [2.0] * 3, [0.5] * 3])
    torch.testing.assert_close(weights, expected)
    assert changed.tolist() == [[False] * 3, [True] * 3, [True] * 3]


def test_sequence_mask():
    algo = AlgoConfig(tis_level="sequence", tis_mode="mask", tis_clip=2.0, tis_clip_low=0.5)
    weights, changed = importance_weights(*_sequence_inputs(), algo)
    # rows 1 (3.004) and 2 (0.2466) fall outside [0.5, 2]: the whole sample is left out
    expected = _t([[math.exp(0.5)] * 3, [0.0] * 3, [0.0] * 3])
    torch.testing.assert_close(weights, expected)
    assert changed.tolist() == [[False] * 3, [True] * 3, [True] * 3]


def test_sequence_level_is_the_product_of_token_ratios():
    algo = AlgoConfig(tis_level="sequence", tis_clip=100.0)
    # token ratios 1.5, 2, 0.8 (0.8's token masked out) -> product 3 on every token
    rollout = _t([[-1.0, -1.0, -1.0]])
    old = rollout + _t([[math.log(1.5), math.log(2.0), math.log(0.8)]])
    weights, changed = importance_weights(old, rollout, _t([[1, 1, 0]]), algo)
    torch.testing.assert_close(weights, _t([[3.0, 3.0, 3.0]]))
    assert not changed.any()


@pytest.mark.parametrize("mode, expected", [("clamp", 2.0), ("mask", 0.0)])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_huge_log_ratio_stays_finite(level, mode, expected):
    algo = AlgoConfig(tis_level=level, tis_mode=mode, tis_clip=2.0)
    rollout = _t([[-1.0, -1.0]])
    old = rollout + _t([[1000.0, 0.0]])
    weights, changed = importance_weights(old, rollout, _t([[1, 0]]), algo)
    assert torch.isfinite(weights).all()
    assert weights[0, 0].item() == expected
    assert bool(changed[0, 0])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_carry_no_gradient(level):
    algo = AlgoConfig(tis_level=level, tis_clip=2.0)
    old = _t([[-1.0, -0.5]]).requires_grad_(True)
    rollout = _t([[-1.2, -0.4]]).requires_grad_(True)
    weights, _ = importance_weights(old, rollout, _t([[1, 1]]), algo)
    assert not weights.requires_grad
    assert weights.grad_fn is None


# d = log pi_old - log pi_rollout per token: 0.1, -0.5, 0
REJECTION_D = [[0.1, -0.5, 0.0]]


@pytest.mark.parametrize(
    ("estimator", "threshold"),
    [
        ("k1", 0.2),  # |d| = 0.1, 0.5, 0
        ("k2", 0.1),  # d^2 / 2 = 0.005, 0.125, 0
        ("k3", 0.01),  # exp(-d) + d - 1 = 0.00484, 0.14872, 0
    ],
)
def test_token_rejection_leaves_out_the_token_whose_gap_exceeds_the_threshold(estimator, threshold):
    algo = AlgoConfig(rejection_level="token", rejection_estimator=estimator, rejection_threshold=threshold)
    rollout = _t([[-1.0, -2.0, -0.5]])
    kept = kept_by_rejection(rollout + _t(REJECTION_D), rollout, torch.ones(1, 3, dtype=F64), algo)
    assert kept.tolist() == [[True, False, True]]


def test_sequence_rejection_takes_the_mean_gap_over_the_trained_tokens():
    # k1: row 0 mean(|0.1|, |-0.5|) = 0.3 > 0.2, rejected whole; row 1 mean(0.1, 0.1) = 0.1, its untrained 5.0 ignored
    algo = AlgoConfig(rejection_level="sequence", rejection_estimator="k1", rejection_threshold=0.2)
    rollout = torch.zeros(2, 3, dtype=F64)
    old = _t([[0.1, -0.5, 0.0], [0.1, 0.1, 5.0]])
    kept = kept_by_rejection(old, rollout, _t([[1, 1, 0], [1, 1, 0]]), algo)
    assert kept.tolist() == [[False, False, False], [True, True, True]]


def test_rejection_off_keeps_everything():
    kept = kept_by_rejection(_t([[9.0]]), _t([[0.0]]), _t([[1.0]]), AlgoConfig())
    assert kept.tolist() == [[True]]


def test_rejection_needs_the_trainers_own_old_logprobs():
    with pytest.raises(ValueError, match="rejection_level needs the trainer's own old log-probs"):
        AlgoConfig(rejection_level="token", use_rollout_logprobs=True)
