"""Trackers write what their own readers return: steps are rollout ids (of iterations and of evaluations), a resumed
run continues the same tracker run, catches up what it missed, and never logs a step twice."""

from __future__ import annotations

import pytest

from miles.observe.trackers import Trackers
from miles.state.run_dir import RunDir
from tests.helpers.wandb_records import history

CONFIG = {"rollout": {"engine": "torch", "n_samples_per_prompt": 8}, "train": {"lr": 0.001}}


def _record(rollout_id: int) -> dict:
    return {"rollout_id": rollout_id, "finished_at": 1.0e9, "reward_mean": 0.1 * rollout_id, "optimizer_steps": 2}


def _evaluation(rollout_id: int) -> dict:
    return {
        "rollout_id": rollout_id,
        "eval": "sums",
        "weight_version": rollout_id,
        "reward_mean": 0.5,
        "pass_at_1": 0.5,
    }


def _two_starts(tmp_path, name: str) -> RunDir:
    """Rollouts 0-2 logged with evaluations at 0 and 2 before them; the process dies after writing rollout 3's
    metrics line and the evaluation at 4 (its tracker never got them); a new process catches up on both, logs
    rollout 4 and the final evaluation at 5, and records already logged are offered again."""
    run_dir = RunDir(tmp_path / "run").create()
    trackers = Trackers([name], run_dir, CONFIG, "tests", "run")
    for rollout_id in range(3):
        if rollout_id % 2 == 0:
            run_dir.append_metrics(_evaluation(rollout_id))
            trackers.log(_evaluation(rollout_id))
        run_dir.append_metrics(_record(rollout_id))
        trackers.log(_record(rollout_id))
    run_dir.append_metrics(_record(3))
    run_dir.append_metrics(_evaluation(4))
    trackers.close()

    resumed = Trackers([name], run_dir, CONFIG, "tests", "run")
    run_dir.append_metrics(_record(4))
    resumed.log(_record(4))
    run_dir.append_metrics(_evaluation(5))
    resumed.log(_evaluation(5))
    resumed.log(_record(2))  # already logged: skipped
    resumed.log(_evaluation(4))
    curve = tmp_path / "curve.png"
    _png(curve)
    resumed.log_image("reward_curve", curve, 4)
    resumed.close()
    return run_dir


def _png(path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1), dpi=50)
    ax.plot([0, 1], [0, 1])
    fig.savefig(path)
    plt.close(fig)


def test_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _two_starts(tmp_path, "tensorboard")
    events = EventAccumulator(str(run_dir.path / "tensorboard"), size_guidance={"images": 0}).Reload()
    steps = [(e.step, round(e.value, 4)) for e in events.Scalars("reward_mean")]
    assert steps == [(i, round(0.1 * i, 4)) for i in range(5)]
    assert [e.step for e in events.Scalars("eval/sums/pass_at_1")] == [0, 2, 4, 5]
    assert "eval/sums/weight_version" in events.Tags()["scalars"] and "eval" not in events.Tags()["scalars"]
    assert [e.step for e in events.Images("reward_curve")] == [4]


def test_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = _two_starts(tmp_path, "mlflow")
    client = MlflowClient(f"sqlite:///{run_dir.path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tests")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the resumed start continued the same run
    run = runs[0]
    assert run.data.params["rollout.engine"] == '"torch"' and run.data.params["train.lr"] == "0.001"
    history_ = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted(m.step for m in history_) == [0, 1, 2, 3, 4]
    evaluations = client.get_metric_history(run.info.run_id, "eval/sums/reward_mean")
    assert sorted(m.step for m in evaluations) == [0, 2, 4, 5]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["curve.png"]


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = _two_starts(tmp_path, "wandb")
    files = sorted((run_dir.path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({f.name for f in files}) == 1  # two starts of one run id
    steps = [step for f in files for step, items in history(f) if "reward_mean" in items]
    assert steps == [0, 1, 2, 3, 4]
    evaluations = [step for f in files for step, items in history(f) if "eval/sums/pass_at_1" in items]
    assert evaluations == [0, 2, 4, 5]


def test_no_tracker_writes_nothing(tmp_path):
    run_dir = RunDir(tmp_path / "run").create()
    trackers = Trackers([], run_dir, CONFIG, "tests", "run")
    trackers.log(_record(0))
    trackers.close()
    assert not (run_dir.path / "trackers.json").exists()
