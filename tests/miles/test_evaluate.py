"""Evaluation metrics: pass@k (Chen et al. 2021) and the mean reward, on hand-computed values; the rows evaluated."""

from __future__ import annotations

import math

import pytest

from miles.config import EvalDatasetConfig
from miles.evaluation.evaluate import EvalSet, eval_metrics, pass_at_k, pass_ks


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 1 - 3 / 5),  # 1 - C(3,1)/C(5,1)
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
        (5, 2, 4, 1.0),  # fewer than k failures: some drawn sample passes
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (8, 0, 4, 0.0),
        (8, 8, 1, 1.0),
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_is_reported_for_powers_of_two_and_n():
    assert pass_ks(1) == [1]
    assert pass_ks(4) == [1, 2, 4]
    assert pass_ks(6) == [1, 2, 4, 6]


def test_eval_metrics_average_pass_at_k_over_prompts_and_leave_failed_rewards_out_of_the_mean():
    # Three prompts, two samples each: passes 1, 0 and 2 (a failed reward does not pass).
    rewards = [1.0, 0.0, None, 0.0, 1.0, 1.0]
    metrics = eval_metrics(rewards, n=2, pass_threshold=1.0)
    assert metrics["reward_mean"] == pytest.approx(3 / 5)
    assert metrics["pass_at_1"] == pytest.approx((1 / 2 + 0 + 1) / 3)
    assert metrics["pass_at_2"] == pytest.approx((1 + 0 + 1) / 3)
    partial = eval_metrics([0.5, 0.75], n=2, pass_threshold=0.7)
    assert partial["reward_mean"] == pytest.approx(0.625) and partial["pass_at_1"] == pytest.approx(0.5)
    assert math.isnan(eval_metrics([None], n=1, pass_threshold=1.0)["reward_mean"])


def test_the_rows_evaluated_are_a_fixed_sample_or_the_first():
    rows = [{"prompt": str(i), "label": str(i)} for i in range(50)]
    sampled = EvalSet(EvalDatasetConfig(name="a", task="addition", max_prompts=10), rows, None)
    assert len(sampled.evaluated_rows(0)) == 10 and sampled.evaluated_rows(0) == sampled.evaluated_rows(0)
    assert sampled.evaluated_rows(0) != sampled.evaluated_rows(1)
    first = EvalSet(EvalDatasetConfig(name="a", task="addition", max_prompts=10, shuffle=False), rows, None)
    assert first.evaluated_rows(0) == rows[:10]
    assert EvalSet(EvalDatasetConfig(name="a", task="addition"), rows, None).evaluated_rows(0) == rows
