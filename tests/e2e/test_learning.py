"""The learning bar of the embedded default: the full warm-up and RL run, as `make run` does it (without Prefect)."""

import json
from pathlib import Path

from miles.config import load_config
from miles.loop import run_sync
from miles.run import RLRun


def test_default_config_learns_addition(ray_session, tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_CACHE", str(tmp_path / "cache"))
    config = load_config(None, run_dir=str(tmp_path / "run"))
    records = run_sync(config)
    rewards = [r["reward_mean"] for r in records]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20

    with RLRun(config) as run:  # a finished run resumes with nothing to do; it evaluates the final checkpoint
        assert len(run.rollout_ids()) == 0
        accuracy = run.evaluate(config.num_rollout - 1)

    report = {"first20": first, "last20": last, **accuracy}
    (Path(config.run_dir) / "learning.json").write_text(json.dumps(report))
    print(report)
    assert last - first >= 0.1, report
    assert accuracy["greedy_accuracy_final"] - accuracy["greedy_accuracy_initial"] >= 0.15, report
