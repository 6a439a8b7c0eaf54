"""The task history: every task counts itself when it finishes, the API ends up holding them all, and a process
whose embedded API dies with it waits at exit until that API has stored them."""

import os
import subprocess
import sys
from pathlib import Path

from prefect import flow, runtime, task

from tasks.history import finished_task_runs
from tasks.options import task_options
from tests.helpers.history import stored_task_runs

PROJECT = Path(__file__).resolve().parents[2]

attempts: list[int] = []


def _options(retries: int) -> dict:
    return {**task_options(retries), "retry_delay_seconds": 0}


@task(name="steady", **_options(1))
def steady(i: int) -> int:
    return i


@task(name="fails_once", **_options(2))
def fails_once() -> str:
    attempts.append(1)
    if len(attempts) == 1:
        raise ConnectionError("lost the reply")
    return "done"


@task(name="bad_input", **_options(2))
def bad_input() -> None:
    raise ValueError("data.path: no such file")


@flow
def counted(fail: bool) -> int:
    futures = [steady.submit(i) for i in range(3)]
    fails_once()
    for future in futures:
        future.result()
    if fail:
        bad_input()
    return finished_task_runs(runtime.flow_run.id)


def test_each_task_run_counts_once_however_often_it_was_retried(prefect_api):
    attempts.clear()
    state = counted(False, return_state=True)
    assert state.is_completed() and state.result() == 4  # 3 steady + fails_once, whose retry is the same task run
    stored = list(stored_task_runs(state.state_details.flow_run_id).values())
    assert len(stored) == 4 and all(r.state.is_completed() for r in stored)
    assert sorted(r.run_count for r in stored) == [1, 1, 1, 2]


def test_a_failed_flow_run_leaves_its_whole_history_including_the_failure(prefect_api):
    attempts.clear()
    state = counted(True, return_state=True)
    assert state.is_failed()
    assert finished_task_runs(state.state_details.flow_run_id) == 5
    stored = list(stored_task_runs(state.state_details.flow_run_id).values())
    assert len(stored) == 5 and sum(r.state.is_failed() for r in stored) == 1


RUN_FLOW = """
import sys
from flows.runtime import configure_prefect, start_ephemeral_api
configure_prefect()
from prefect import flow, task
from tasks.options import task_options

@task(name="step", **task_options(0))
def step(i):
    return i

@flow(name="history-at-exit")
def steps(n):
    for i in range(n):
        step(i)

start_ephemeral_api()
print(steps(int(sys.argv[1]), return_state=True).state_details.flow_run_id, flush=True)
"""

COUNT_STORED = """
import sys
from flows.runtime import configure_prefect, start_ephemeral_api
configure_prefect()
from prefect.client.orchestration import get_client
start_ephemeral_api()
query = {"task_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}, "flow_runs": {"id": {"any_": [sys.argv[1]]}}}
with get_client(sync_client=True) as client:
    print(client.request("POST", "/task_runs/count", json=query).json())
"""


def test_a_process_with_the_embedded_api_leaves_the_whole_history_in_its_database(tmp_path):
    # The process exits the moment its flow returns, while the server still has the last task runs' events in flight
    # (without the wait at exit, 173 of these 200 reached the database here).
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(PROJECT)}
    env.pop("PREFECT_API_URL", None)

    def python(script: str, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", script, *args], env=env, cwd=PROJECT, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip().splitlines()[-1]

    flow_run_id = python(RUN_FLOW, "200")
    assert python(COUNT_STORED, flow_run_id) == "200"
