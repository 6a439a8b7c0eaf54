"""Pause, steer, resume and cancel a running flow through the Prefect API, as the UI, the CLI and automations do."""

import json
import threading

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowRunFilter
from prefect.states import Cancelling, Paused
from safetensors.torch import load_file

from control.requests import resume
from flows.async_rl import async_rl
from flows.cli import main as miles
from flows.multi_lora import multi_lora
from flows.sync_rl import sync_rl
from miles.config import ConfigError
from miles.loop import run_multi_lora, run_sync
from miles.rollout.store import RolloutStore
from miles.state.run_dir import RunDir
from tests.helpers import final_weights, max_abs_diff
from tests.helpers.faults import assert_same_samples
from tests.helpers.history import flow_run_artifacts
from tests.helpers.waiting import eventually

NEW_LR = 3e-3
RUN = dict(num_rollout=10, save_interval=20)


@pytest.fixture(autouse=True)
def quick_watch(monkeypatch):
    monkeypatch.setenv("MILES_CONTROL_POLL_S", "0.5")


def _running_flow_run(flow_name: str, run_dir: str | None):
    """The running flow run of `flow_name` on `run_dir` (any, when None)."""
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name={"any_": [flow_name]}),
            flow_run_filter=FlowRunFilter(state={"type": {"any_": ["RUNNING"]}}),
        )
    return next((r for r in runs if run_dir is None or r.parameters["config"]["run_dir"] == run_dir), None)


def _state(flow_run_id):
    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def _operate(flow_name: str, run_dir: str | None, ask, answer) -> threading.Thread:
    """Once the flow run runs, `ask(flow_run_id)` (its engines and trainer are still starting: the request is seen
    before the first iteration ends); once it has paused itself at a boundary, `answer(flow_run_id, pause_key)`.
    Errors are kept in the thread's `errors`."""

    def operate():
        try:
            flow_run = eventually(lambda: _running_flow_run(flow_name, run_dir), timeout_s=120, every_s=0.1)
            ask(flow_run.id)
            if answer is not None:
                paused = eventually(
                    lambda: (s := _state(flow_run.id)).is_paused() and s.state_details.pause_key and s,
                    timeout_s=120,
                    every_s=0.2,
                )
                answer(flow_run.id, paused.state_details.pause_key)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            thread.errors.append(exc)

    thread = threading.Thread(target=operate)
    thread.errors = []
    thread.start()
    return thread


def _cancel_as_prefect_does(flow_run_id):
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling())


def test_a_paused_state_pauses_at_a_boundary_and_the_form_resumes_with_a_new_lr_as_a_run_started_with_it(
    ray_session, prefect_api, small_config, tmp_path
):
    config = small_config(**RUN)
    form = {}

    def pause_as_an_automation_does(flow_run_id):  # a Paused state, not forced
        with get_client(sync_client=True) as client:
            assert client.set_flow_run_state(flow_run_id, Paused(timeout_seconds=300)).status.value == "ACCEPT"

    def answer_in_the_form(flow_run_id, pause_key):
        with get_client(sync_client=True) as client:
            form.update(json.loads(client.read_flow_run_input(flow_run_id, f"paused-{pause_key}-schema")))
        resume(flow_run_id, {"lr": NEW_LR}, by="ops", reason="reward plateaued")

    operator = _operate("rl-sync", config.run_dir, pause_as_an_automation_does, answer_in_the_form)
    state = sync_rl(config, return_state=True)
    operator.join()
    assert not operator.errors, operator.errors
    assert state.is_completed(), state.message

    # The form offered every value a run may change, prefilled with the value in effect.
    assert form["properties"]["lr"]["default"] == 1e-3 and form["properties"]["temperature"]["default"] == 1.0
    (change,) = RunDir(config.run_dir).recorded_changes()
    at = change["rollout_id"]
    assert at == 1, change  # the boundary after the first iteration
    assert (change["values"], change["by"], change["reason"]) == ({"train.lr": NEW_LR}, "ops", "reward plateaued")
    metrics = RunDir(config.run_dir).metrics()
    assert [m["lr"] for m in metrics] == [1e-3] * at + [NEW_LR] * (RUN["num_rollout"] - at)
    assert [m["rollout_id"] for m in metrics if "config_change" in m] == [at]
    artifact = next(a for a in flow_run_artifacts(state.state_details.flow_run_id) if a.key == "rl-sync-config-changes")
    (row,) = json.loads(artifact.data)
    assert (row["rollout_id"], row["field"], row["from"], row["to"], row["by"]) == (at, "train.lr", 1e-3, NEW_LR, "ops")

    # The rest of the run equals a run started with that schedule.
    scheduled = small_config(
        f"changes=[{{rollout_id: {at}, values: {{train.lr: {NEW_LR}}}}}]", run_dir=tmp_path / "scheduled", **RUN
    )
    run_sync(scheduled)
    last = RUN["num_rollout"] - 1
    assert max_abs_diff(final_weights(scheduled.run_dir, last), final_weights(config.run_dir, last)) == 0


def test_the_cli_pauses_the_async_flow_releasing_its_workers_after_it_drains_and_resumes_with_a_new_temperature(
    ray_session, prefect_api, small_config
):
    config = small_config("algo.use_tis=true", **RUN)
    operator = _operate(
        "rl-async",
        config.run_dir,
        lambda flow_run_id: miles(["pause", str(flow_run_id), "--release", "--reason", "look at the samples"]),
        lambda flow_run_id, _: miles(["resume", str(flow_run_id), "--set", "temperature=0.7", "--by", "ops"]),
    )
    state = async_rl(config, return_state=True)
    operator.join()
    assert not operator.errors, operator.errors
    assert state.is_completed(), state.message
    (change,) = RunDir(config.run_dir).recorded_changes()
    assert change["values"] == {"rollout.temperature": 0.7} and change["by"] == "ops"
    # Asked before the first iteration ended: no generation started after the ask; the pause came with none in flight,
    # and the next rollout was generated after the change, at the new temperature.
    assert change["rollout_id"] == 1
    assert RolloutStore(RunDir(config.run_dir).rollouts).path(1).stat().st_mtime > change["time"]
    assert [m["rollout_id"] for m in RunDir(config.run_dir).metrics()] == list(range(RUN["num_rollout"]))


def test_a_cancelled_flow_run_ends_cancelled_at_a_boundary_and_its_run_resumes(
    ray_session, prefect_api, small_config, tmp_path
):
    config = small_config(**RUN)

    operator = _operate("rl-sync", config.run_dir, _cancel_as_prefect_does, None)
    state = sync_rl(config, return_state=True)
    operator.join()
    assert not operator.errors, operator.errors
    assert state.is_cancelled(), state.name
    trained = sorted(RunDir(config.run_dir).ledger().trained)
    assert trained == [0] and RunDir(config.run_dir).checkpoint(0).is_dir()

    assert sync_rl(config, return_state=True).is_completed()
    uninterrupted = small_config(run_dir=tmp_path / "uninterrupted", **RUN)
    run_sync(uninterrupted)
    last = RUN["num_rollout"] - 1
    assert max_abs_diff(final_weights(uninterrupted.run_dir, last), final_weights(config.run_dir, last)) == 0


ADAPTERS = (
    "adapters=[{name: add, data: {task: addition, reward: digit_match}, num_steps: 4, rollout_batch_size: 4,"
    " n_samples_per_prompt: 4}, {name: sub, data: {task: subtraction, reward: digit_match}, num_steps: 4,"
    " rollout_batch_size: 2, n_samples_per_prompt: 4, global_batch_size: 4}]"
)


def test_the_multi_lora_flow_cancels_and_pauses_at_a_boundary_with_every_adapter_saved(
    ray_session, prefect_api, small_config, tmp_path
):
    config = small_config(ADAPTERS, save_interval=20)
    adapters = {name: RunDir(config.run_dir).adapter(name) for name in ("add", "sub")}

    operator = _operate("rl-multi-lora", config.run_dir, _cancel_as_prefect_does, None)
    state = multi_lora(config, return_state=True)
    operator.join()
    assert not operator.errors, operator.errors
    assert state.is_cancelled(), state.name
    for adapter in adapters.values():  # each saved after its last rollout, where the next flow run resumes it
        trained = sorted(adapter.ledger().trained)
        assert len(trained) < 4 and (not trained or adapter.checkpoint(trained[-1]).is_dir())

    refused = []

    def resume_without_changes(flow_run_id, pause_key):
        with pytest.raises(ConfigError, match="paused without a form"):
            resume(flow_run_id, {"lr": 0.1})
        refused.append(pause_key)
        miles(["resume", str(flow_run_id), "--by", "ops"])

    operator = _operate(
        "rl-multi-lora",
        config.run_dir,
        lambda flow_run_id: miles(["pause", str(flow_run_id), "--release"]),
        resume_without_changes,
    )
    state = multi_lora(config, return_state=True)
    operator.join()
    assert not operator.errors, operator.errors
    assert state.is_completed(), state.message
    assert refused == ["boundary-hold-1"]
    for adapter in adapters.values():
        assert sorted(adapter.ledger().trained) == [0, 1, 2, 3]

    uninterrupted = small_config(ADAPTERS, save_interval=20, run_dir=tmp_path / "uninterrupted")
    run_multi_lora(uninterrupted)
    for name, adapter in adapters.items():
        alone = RunDir(uninterrupted.run_dir).adapter(name)
        assert_same_samples(adapter.path, alone.path, range(4))
        weights = [load_file(str(a.checkpoint(3) / "adapter" / "adapter_model.safetensors")) for a in (adapter, alone)]
        assert max_abs_diff(*weights) < 1e-4  # float rounding: the engines batch whatever is in flight
