"""What a schedule does at an iteration boundary when asked (miles.schedules.Control), without Prefect: a pause that
changes values equals a run started with that schedule of changes, held or released; the async graphs drain first;
a cancel leaves a run directory that resumes."""

from dataclasses import replace

import pytest

from miles import schedules
from miles.config import ConfigChange, ConfigError, MidRunSettings
from miles.loop import plain_steps, run_sync
from miles.rollout.store import RolloutStore
from miles.run import RLRun
from miles.run_dir import RunDir
from tests.helpers import final_weights, max_abs_diff

NEW_LR = 3e-3
RUN = dict(num_rollout=4, save_interval=10)


class ScriptedControl:
    """Asks `action` once the run has trained `after` rollouts; a pause applies `values` (the form's fields)."""

    def __init__(self, action: str, after: int, values: dict | None = None, release: bool = False):
        self.action, self.after, self.values, self.release = action, after, values or {}, release
        self.run = None
        self.paused_at: list[int] = []
        self.in_flight_at_pause: list[list[int]] = []

    def requested(self):
        if self.paused_at or self.run is None:
            return None
        return self.action if len(self.run.iterations.ledger.trained) >= self.after else None

    def pause(self, run, next_rollout_id):
        store = RolloutStore(run.run_dir.rollouts)
        generated = [i for i in range(run.config.final.num_rollout + 2) if store.exists(i)]
        self.in_flight_at_pause.append(sorted(set(generated) - set(run.iterations.ledger.trained)))
        self.paused_at.append(next_rollout_id)
        if self.release:
            run.release()
            run.start_again()
        settings = MidRunSettings.of(run.config, next_rollout_id).model_copy(
            update={**self.values, "changed_by": "tester", "reason": "lower the step"}
        )
        change = settings.change(run.config, next_rollout_id)
        if change is not None:
            run.change_config(change)


def _run(config, schedule, control):
    with RLRun(config) as run, plain_steps() as steps:
        control.run = run
        return [run.finish_iteration(i) for i in schedule(run, replace(steps, control=control))]


@pytest.mark.parametrize("release", [False, True], ids=["held", "released"])
def test_a_pause_that_changes_the_lr_equals_a_run_started_with_that_change(
    ray_session, small_config, tmp_path, release
):
    control = ScriptedControl("pause", after=2, values={"lr": NEW_LR}, release=release)
    records = _run(small_config(**RUN), schedules.sync, control)
    assert control.paused_at == [2]
    assert [r["lr"] for r in records] == [1e-3, 1e-3, NEW_LR, NEW_LR]
    assert [r.get("config_change") for r in records] == [None, None, {"train.lr": NEW_LR}, None]
    (recorded,) = RunDir(small_config(**RUN).run_dir).recorded_changes()
    assert recorded["rollout_id"] == 2 and recorded["values"] == {"train.lr": NEW_LR}
    assert recorded["by"] == "tester" and recorded["reason"] == "lower the step"

    scheduled = small_config(
        f"changes=[{{rollout_id: 2, values: {{train.lr: {NEW_LR}}}}}]", run_dir=tmp_path / "scheduled", **RUN
    )
    expected = run_sync(scheduled)
    assert max_abs_diff(final_weights(scheduled.run_dir, 3), final_weights(small_config(**RUN).run_dir, 3)) == 0
    for got, want in zip(records, expected, strict=True):
        assert got["loss"] == want["loss"] and got["reward_mean"] == want["reward_mean"]


def test_the_async_graph_drains_what_is_in_flight_before_it_pauses(ray_session, small_config):
    config = small_config("algo.use_tis=true", **RUN)
    control = ScriptedControl("pause", after=1, values={"temperature": 0.7})
    records = _run(config, schedules.one_step_off_policy, control)
    # Rollout 1 was generated beside the training of rollout 0: it is trained before the pause, none is in flight.
    assert control.paused_at == [2] and control.in_flight_at_pause == [[]]
    assert [r["rollout_id"] for r in records] == [0, 1, 2, 3]
    assert RunDir(config.run_dir).recorded_changes()[0]["values"] == {"rollout.temperature": 0.7}


def test_a_cancelled_run_stops_at_the_boundary_and_resumes(ray_session, small_config, tmp_path):
    config = small_config(**RUN)
    records = _run(config, schedules.sync, ScriptedControl("cancel", after=2))
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert (RunDir(config.run_dir).checkpoint(1)).is_dir()  # saved at the boundary, though no save was due
    resumed = run_sync(config)
    assert [r["rollout_id"] for r in resumed] == [2, 3]
    uninterrupted = small_config(run_dir=tmp_path / "uninterrupted", **RUN)
    run_sync(uninterrupted)
    assert max_abs_diff(final_weights(uninterrupted.run_dir, 3), final_weights(config.run_dir, 3)) == 0


def test_a_change_is_refused_when_it_cannot_apply(ray_session, small_config):
    with RLRun(small_config(**RUN)) as run:
        with pytest.raises(ConfigError, match="num_rollout: 1 ends the run before rollouts it has trained"):
            run.change_config(ConfigChange(rollout_id=2, values={"num_rollout": 1}))
        with pytest.raises(ConfigError, match="changes due at rollout 0"):
            run.change_config(ConfigChange(rollout_id=0, values={"train.lr": -1.0}))
        assert run.config.changes == [] and RunDir(run.config.run_dir).recorded_changes() == []
