"""What a schedule does at an iteration boundary when asked (miles.schedules.Control), without Prefect: a pause that
changes values equals a run started with that schedule of changes, held or released; the async graphs drain first;
a cancel leaves a run directory that resumes."""

from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file

from miles import schedules
from miles.config import ConfigChange, ConfigError, MidRunSettings
from miles.graphs import GRAPHS
from miles.loop import plain_steps, run_multi_lora, run_sync
from miles.multi_lora.run import MultiLoRARun
from miles.rollout.store import RolloutStore
from miles.run import RLRun
from miles.state.run_dir import RunDir
from tests.helpers import final_weights, max_abs_diff, small_config_for
from tests.helpers.faults import assert_same_samples

ADAPTER_WEIGHTS = "adapter_model.safetensors"
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


@pytest.mark.parametrize(
    "schedule, window", [(schedules.one_step_off_policy, 1), (schedules.fully_async, 2)], ids=["async", "fully-async"]
)
def test_the_async_graphs_drain_what_is_in_flight_before_they_pause(ray_session, small_config, schedule, window):
    config = small_config("algo.use_tis=true", f"rollout.max_rollouts_in_flight={window}", **RUN)
    control = ScriptedControl("pause", after=1, values={"temperature": 0.7})
    records = _run(config, schedule, control)
    # Asked once rollout 0 was trained: the `window` rollouts generated beside it are trained before the pause, and
    # none is in flight at it.
    assert control.paused_at == [1 + window] and control.in_flight_at_pause == [[]]
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


ADAPTERS = (
    "adapters=[{name: add, data: {task: addition, reward: digit_match}, num_steps: 3, rollout_batch_size: 4,"
    " n_samples_per_prompt: 4}, {name: sub, data: {task: subtraction, reward: digit_match}, num_steps: 3,"
    " rollout_batch_size: 2, n_samples_per_prompt: 4, global_batch_size: 4}]"
)


class ScriptedHold:
    """Asks `action` of a multi-LoRA run once adapter `add` has trained `after` rollouts; a pause holds, releasing
    the engines and trainer groups when `release`."""

    def __init__(self, action: str, after: int, release: bool = False):
        self.action, self.after, self.release = action, after, release
        self.run = None
        self.trained_at_hold: list[dict[str, list[int]]] = []

    def requested(self):
        if self.trained_at_hold or self.run is None:
            return None
        return self.action if len(self.run.adapters["add"].iterations.ledger.trained) >= self.after else None

    def hold(self, run):
        self.trained_at_hold.append({name: sorted(a.iterations.ledger.trained) for name, a in run.adapters.items()})
        if self.release:
            run.release()
            run.start_again()


def _run_adapters(config, control) -> dict[str, list[int]]:
    """Each adapter's rollouts trained by this run."""
    trained: dict[str, list[int]] = {}
    with MultiLoRARun(config) as run, plain_steps() as steps:
        control.run = run
        for adapter, rollout_id in GRAPHS["multi-lora"].schedule(run, replace(steps, control=control)):
            adapter.finish_iteration(rollout_id)
            trained.setdefault(adapter.name, []).append(rollout_id)
    return trained


def _adapter_weights(run_dir, adapter: str) -> dict:
    return load_file(str(Path(run_dir) / "adapters" / adapter / "checkpoints" / "2" / "adapter" / ADAPTER_WEIGHTS))


@pytest.fixture(scope="module")
def uninterrupted_adapters(ray_session, tiny_model_dir, tmp_path_factory):
    config = small_config_for(tiny_model_dir, tmp_path_factory.mktemp("adapters") / "run", ADAPTERS, **RUN)
    run_multi_lora(config)
    return config.run_dir


def _assert_as_uninterrupted(run_dir, uninterrupted_dir) -> None:
    """The same samples, and the adapters' weights as the multi-LoRA recoveries leave them (float rounding: the
    engines and the trainer group batch whatever is in flight)."""
    for name in ("add", "sub"):
        assert_same_samples(Path(run_dir) / "adapters" / name, Path(uninterrupted_dir) / "adapters" / name, range(3))
        assert max_abs_diff(_adapter_weights(run_dir, name), _adapter_weights(uninterrupted_dir, name)) < 1e-4


def test_a_multi_lora_run_released_at_a_boundary_saves_every_adapter_and_trains_on_as_if_never_paused(
    ray_session, small_config, uninterrupted_adapters
):
    config = small_config(ADAPTERS, **RUN)
    control = ScriptedHold("pause", after=1, release=True)
    trained = _run_adapters(config, control)
    (at_hold,) = control.trained_at_hold
    assert len(at_hold["add"]) >= 1
    for name, rollouts in at_hold.items():  # nothing in flight: each adapter saved after its last rollout
        if rollouts:
            assert (Path(config.run_dir) / "adapters" / name / "checkpoints" / str(rollouts[-1])).is_dir()
    assert trained == {"add": [0, 1, 2], "sub": [0, 1, 2]}
    _assert_as_uninterrupted(config.run_dir, uninterrupted_adapters)


def test_a_cancelled_multi_lora_run_stops_with_every_adapter_saved_and_resumes_to_the_same_weights(
    ray_session, small_config, uninterrupted_adapters
):
    config = small_config(ADAPTERS, **RUN)
    first = _run_adapters(config, ScriptedHold("cancel", after=1))
    assert 1 <= len(first["add"]) < 3
    resumed = _run_adapters(config, ScriptedHold("cancel", after=99))
    for name in ("add", "sub"):
        assert first.get(name, []) + resumed.get(name, []) == [0, 1, 2]
    _assert_as_uninterrupted(config.run_dir, uninterrupted_adapters)
