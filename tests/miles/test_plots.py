"""miles.observe.plots: the running mean on hand-computed values, and each curve written as a PNG."""

from pathlib import Path

import pytest

from miles.observe.plots import data_uri, plot_eval_curve, plot_reward_curve, plot_reward_curves, running_mean

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_running_mean_averages_each_value_with_those_before_it_within_the_window():
    assert running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert running_mean([1.0, 3.0, 5.0], 10) == [1.0, 2.0, 3.0]
    assert running_mean([], 3) == []


def test_each_curve_is_a_png_where_it_was_asked_for(tmp_path: Path):
    records = [{"rollout_id": i, "reward_mean": 0.1 * i, "pass_at_1": 0.1 * i, "pass_at_4": 0.2 * i} for i in range(5)]
    written = [
        plot_reward_curve(records, "reward", tmp_path / "reward.png"),
        plot_eval_curve(records, "eval", tmp_path / "eval.png"),
        plot_reward_curves({"a": records, "b": records[:3]}, "sweep", tmp_path / "nested" / "sweep.png"),
    ]
    assert written == [tmp_path / "reward.png", tmp_path / "eval.png", tmp_path / "nested" / "sweep.png"]
    for png in written:
        assert png.read_bytes().startswith(PNG)
    assert data_uri(written[0]).startswith("data:image/png;base64,iVBORw0KGgo")


@pytest.mark.parametrize("window", [1, 3])
def test_a_window_of_one_is_the_values_themselves_and_a_longer_one_smooths(window):
    values = [0.0, 1.0, 0.0, 1.0]
    smoothed = running_mean(values, window)
    assert (smoothed == values) == (window == 1)
