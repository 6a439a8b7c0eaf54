"""miles.observe.alerts on hand-written iteration records."""

import math

from miles.config import AlertsConfig
from miles.observe.alerts import RewardCollapse, unhealthy

ALERTS = AlertsConfig(reward_collapse_window=2, reward_collapse_drop=0.5, failed_reward_fraction=0.5)


def test_an_iteration_is_unhealthy_for_each_value_not_finite_and_for_rewards_failing_on_half_its_samples():
    healthy = {"reward_mean": 0.5, "loss": 0.1, "grad_norm": 1.0, "samples": 32, "failed_samples": 15}
    assert unhealthy(healthy, ALERTS) == []
    record = {**healthy, "loss": math.nan, "grad_norm": math.inf, "failed_samples": 16}
    assert unhealthy(record, ALERTS) == ["loss is nan", "grad_norm is inf", "the reward failed on 16 of 32 samples"]


def test_a_collapse_is_the_latest_window_below_half_the_best_earlier_window_reported_once_until_it_recovers():
    collapse = RewardCollapse(ALERTS, history=[0.2])
    # windows of 2: best earlier mean 0.6 (0.5, 0.7) once the history allows two windows; threshold 0.3
    seen = [collapse.update(r) for r in [0.5, 0.7, 0.4, 0.3, 0.2, 0.1, 0.5, 0.6, 0.1, 0.1]]
    # after 0.2: latest (0.3 + 0.2) / 2 = 0.25 < 0.3 -> collapsed; 0.1 keeps it collapsed (not reported again);
    # 0.5: (0.1 + 0.5) / 2 = 0.3, not below -> recovered; 0.1, 0.1: (0.1 + 0.1) / 2 = 0.1 < 0.3 -> reported again
    reported = [i for i, s in enumerate(seen) if s is not None]
    assert reported == [4, 9]
    assert seen[4] == {"latest": 0.25, "best": 0.6, "threshold": 0.3}
    assert collapse.update(math.nan) is None  # an iteration whose every reward failed says nothing of the trend


def test_a_reward_that_never_rose_does_not_collapse():
    collapse = RewardCollapse(ALERTS)
    assert [collapse.update(r) for r in [0.0, 0.0, 0.0, 0.0, 0.0]] == [None] * 5
