"""miles.train.advantages.grpo_advantages against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from miles.train.advantages import grpo_advantages

# Four groups, interleaved and given with non-contiguous ids:
#   group 7: rewards 1, 0, 0      mean 1/3, centred 2/3, -1/3, -1/3
#            unbiased var = (4/9 + 1/9 + 1/9) / (3 - 1) = 1/3, std = sqrt(1/3)
#   group 2: rewards 0.5, 1.5     mean 1, centred -0.5, 0.5
#            unbiased var = (0.25 + 0.25) / (2 - 1) = 0.5, std = sqrt(0.5)
#   group 5: rewards 1, 1, 1, 1   all equal: centred 0, std 0 -> 0
#   group 9: reward 0.7           a group of one: centred 0, std 0 -> 0
GROUPS = np.array([7, 2, 5, 7, 5, 2, 9, 5, 7, 5])
REWARDS = np.array([1.0, 0.5, 1.0, 0.0, 1.0, 1.5, 0.7, 1.0, 0.0, 1.0], dtype=np.float32)
CENTRED = [2 / 3, -0.5, 0.0, -1 / 3, 0.0, 0.5, 0.0, 0.0, -1 / 3, 0.0]
STD = [math.sqrt(1 / 3), math.sqrt(0.5), 0.0, math.sqrt(1 / 3), 0.0, math.sqrt(0.5), 0.0, 0.0, math.sqrt(1 / 3), 0.0]


@pytest.mark.parametrize("eps", [1e-6, 0.1])
def test_hand_computation(eps):
    out = grpo_advantages(REWARDS, GROUPS, eps=eps)
    expected = [c / (s + eps) for c, s in zip(CENTRED, STD, strict=True)]
    assert out.dtype == np.float32
    assert out.shape == REWARDS.shape
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_default_eps_value():
    # 2/3 / (sqrt(1/3) + 1e-6) = 1.1547... only slightly below 2/sqrt(3).
    out = grpo_advantages(REWARDS, GROUPS)
    assert out[0] == pytest.approx((2 / 3) / (math.sqrt(1 / 3) + 1e-6), rel=1e-6)


def test_unbiased_std_not_population_std():
    # Two rewards 0 and 1: centred +-0.5; unbiased std sqrt(0.5) (population std would be 0.5 -> +-1).
    out = grpo_advantages(np.array([0.0, 1.0]), np.array([0, 0]), eps=0.0)
    np.testing.assert_allclose(out, [-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)], rtol=1e-6)


def test_order_of_samples_does_not_matter():
    perm = np.array([3, 9, 0, 6, 1, 8, 2, 5, 7, 4])
    straight = grpo_advantages(REWARDS, GROUPS)
    shuffled = grpo_advantages(REWARDS[perm], GROUPS[perm])
    np.testing.assert_allclose(shuffled, straight[perm], rtol=1e-6)


def test_all_equal_rewards_give_zero():
    out = grpo_advantages(np.array([0.3, 0.3, 0.3, 0.0, 0.0]), np.array([1, 1, 1, 0, 0]))
    assert np.all(out == 0.0)


def test_without_std_normalization_rewards_are_centred():
    out = grpo_advantages(REWARDS, GROUPS, std_normalization=False)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, CENTRED, rtol=1e-6, atol=1e-7)


def test_integer_rewards_and_string_groups():
    # Rewards as ints, group ids as strings: the estimator only needs equality of ids.
    out = grpo_advantages(np.array([1, 0, 3, 1]), np.array(["b", "a", "b", "a"]), std_normalization=False)
    # group b: 1, 3 -> mean 2 -> -1, 1; group a: 0, 1 -> mean 0.5 -> -0.5, 0.5
    np.testing.assert_allclose(out, [-1.0, -0.5, 1.0, 0.5])
