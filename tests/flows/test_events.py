"""Iteration and checkpoint events in the Prefect API, and the automations that act on them: the shipped automation
pauses a run whose reward returns NaN; a run's own stall automation flags it when its iterations stop."""

import itertools
import math
import threading
from datetime import UTC, datetime, timedelta

import pytest
from prefect.client.orchestration import get_client
from prefect.states import Running

from control.events import STALLED
from control.requests import PAUSING, resume
from flows.cli import main as miles
from flows.sync_rl import sync_rl
from miles.rewards import digit_match
from miles.state.run_dir import RunDir
from tests.flows.test_control import _operate, _state
from tests.helpers.history import flow_run_artifacts
from tests.helpers.waiting import eventually

SAMPLES = 32  # per rollout of the small config


class ScriptedReward:
    """digit_match, except: on rollout `nan_at` every other sample's reward is NaN; on rollout `hold_at` every call
    waits for `go` (the test sets it once it has seen what it waits for)."""

    def __init__(self, nan_at: int | None = None, hold_at: int | None = None):
        self.nan_at, self.hold_at = nan_at, hold_at
        self.calls = itertools.count()
        self.go = threading.Event()

    def __call__(self, response: str, label: str, finished: bool) -> float:
        call = next(self.calls)
        rollout = call // SAMPLES
        if rollout == self.hold_at:
            self.go.wait(120)
        if rollout == self.nan_at and call % 2:
            return math.nan
        return digit_match(response, label, finished)


@pytest.fixture
def scripted_reward(monkeypatch):
    import tests.flows.test_events as here

    def install(**kwargs):
        monkeypatch.setattr(here, "reward", ScriptedReward(**kwargs), raising=False)
        return here.reward

    return install


@pytest.fixture(autouse=True)
def quick_watch(monkeypatch):
    monkeypatch.setenv("MILES_CONTROL_POLL_S", "0.5")


def _events(prefix: str, since: datetime) -> list[dict]:
    with get_client(sync_client=True) as client:
        response = client._client.post(
            "/events/filter",
            json={"filter": {"event": {"prefix": [prefix]}, "occurred": {"since": since.isoformat()}}, "limit": 50},
        )
    response.raise_for_status()
    return response.json()["events"]


def test_iterations_and_checkpoints_are_events_and_a_nan_reward_pauses_the_run_by_the_shipped_automation(
    ray_session, prefect_api, small_config, scripted_reward
):
    assert miles(["automations", "apply"]) == 0
    reward = scripted_reward(nan_at=2, hold_at=3)
    since = datetime.now(UTC) - timedelta(seconds=1)
    config = small_config("data.reward=tests.flows.test_events:reward", num_rollout=6, save_interval=2)
    seen = {}

    def wait_for_the_automation(flow_run_id):
        def taken():  # the automation set Pausing; the run says it has taken the request
            state = _state(flow_run_id)
            return state.name == PAUSING and state.message.startswith("pauses at") and state

        seen["message"] = eventually(taken, timeout_s=60).message
        # The automation's action once more (Prefect's actions service repeats an action whose call timed out): the
        # run, holding the request, says again that it has taken it.
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Running(name=PAUSING, message="again"), force=True)
        assert eventually(taken, timeout_s=60).message == seen["message"]
        reward.go.set()  # rollout 3 goes on; the run pauses at the boundary after it

    def resume_unchanged(flow_run_id, _):
        seen["paused_before"] = len(RunDir(config.run_dir).ledger().trained)
        resume(flow_run_id, {})

    operator = _operate("rl-sync", config.run_dir, wait_for_the_automation, resume_unchanged)
    state = sync_rl(config, return_state=True)
    reward.go.set()
    operator.join()
    assert not operator.errors, operator.errors
    assert state.is_completed(), state.message
    assert seen == {
        "message": "pauses at the next iteration boundary: an iteration was unhealthy",
        "paused_before": 4,
    }

    flow_run = f"prefect.flow-run.{state.state_details.flow_run_id}"
    iterations = eventually(lambda: len(e := _events("miles.iteration.finished", since)) == 6 and e, timeout_s=30)
    assert all(e["resource"]["prefect.resource.id"] == flow_run for e in iterations)
    by_rollout = {e["payload"]["rollout_id"]: e["payload"] for e in iterations}
    assert sorted(by_rollout) == list(range(6))
    assert by_rollout[2]["failed_samples"] == SAMPLES // 2 and by_rollout[2]["unhealthy"]
    assert by_rollout[1]["unhealthy"] == [] and by_rollout[1]["loss"] == RunDir(config.run_dir).metrics()[1]["loss"]
    (unhealthy,) = _events("miles.iteration.unhealthy", since)
    assert unhealthy["payload"] == {"rollout_id": 2, "problems": [f"the reward failed on 16 of {SAMPLES} samples"]}
    checkpoints = _events("miles.checkpoint.saved", since)
    saved = sorted((e["payload"]["rollout_id"], e["resource"]["miles.checkpoint-path"]) for e in checkpoints)
    assert saved == [(i, str(RunDir(config.run_dir).checkpoint(i))) for i in (1, 3, 5)]
    # Each checkpoint's lineage is a version of the run's lineage artifact.
    lineages = [a for a in flow_run_artifacts(state.state_details.flow_run_id) if a.key == "run-lineage"]
    assert sorted(a.data.splitlines()[0] for a in lineages) == [f"# lineage of checkpoint {i}" for i in (1, 3, 5)]


def test_a_run_whose_iterations_stop_is_flagged_stalled_by_its_own_automation(
    ray_session, prefect_api, small_config, scripted_reward
):
    reward = scripted_reward(hold_at=6)
    config = small_config(
        "data.reward=tests.flows.test_events:reward", "alerts.min_stall_s=10", num_rollout=8, save_interval=20
    )
    seen = {}

    def wait_for_the_flag(flow_run_id):
        stalled = eventually(lambda: _state(flow_run_id).name == STALLED and _state(flow_run_id), timeout_s=90)
        seen["message"] = stalled.message
        seen["trained"] = len(RunDir(config.run_dir).ledger().trained)
        reward.go.set()

    operator = _operate("rl-sync", config.run_dir, wait_for_the_flag, None)
    state = sync_rl(config, return_state=True)
    reward.go.set()
    operator.join()
    assert not operator.errors, operator.errors
    assert state.is_completed(), state.message
    assert seen["trained"] == 6 and "no iteration finished for 10 s" in seen["message"]
    with get_client(sync_client=True) as client:  # the run's own automation is gone with it
        names = [a.name for a in client.read_automations()]
    assert not [name for name in names if name.endswith("stalled")]
