"""The task history: every task counts itself when it finishes, and the flow waits until the API holds them all."""

import asyncio

from prefect import flow, runtime, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter

from flows.runtime import RL_FLOW_OPTIONS
from tasks.history import finished_task_runs
from tasks.options import task_options

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


@flow(**RL_FLOW_OPTIONS)
def counted(fail: bool) -> int:
    futures = [steady.submit(i) for i in range(3)]
    fails_once()
    for future in futures:
        future.result()
    if fail:
        bad_input()
    return finished_task_runs(runtime.flow_run.id)


async def _stored(flow_run_id) -> list:
    async with get_client() as client:
        return await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))


def test_each_task_run_counts_once_however_often_it_was_retried(prefect_api):
    attempts.clear()
    state = counted(False, return_state=True)
    assert state.is_completed() and state.result() == 4  # 3 steady + fails_once, whose retry is the same task run
    stored = asyncio.run(_stored(state.state_details.flow_run_id))  # read at once: the flow waited for them
    assert len(stored) == 4 and all(r.state.is_completed() for r in stored)
    assert sorted(r.run_count for r in stored) == [1, 1, 1, 2]


def test_a_failed_flow_run_leaves_its_whole_history_including_the_failure(prefect_api):
    attempts.clear()
    state = counted(True, return_state=True)
    assert state.is_failed()
    assert finished_task_runs(state.state_details.flow_run_id) == 5
    stored = asyncio.run(_stored(state.state_details.flow_run_id))
    assert len(stored) == 5 and sum(r.state.is_failed() for r in stored) == 1
