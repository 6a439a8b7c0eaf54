"""The shared retry policy: bad input fails at once, transient failures are retried."""

import asyncio

from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter

from miles.config import ConfigError
from tasks.retries import RETRY_DELAYS_S, retry_policy


def _policy_without_waiting(retries):
    return {**retry_policy(retries), "retry_delay_seconds": 0}


attempts: list[str] = []


@task(name="flaky", **_policy_without_waiting(2))
def flaky(error: str) -> str:
    attempts.append(error)
    if len(attempts) == 1:
        raise {"connection": ConnectionError("engine went away"), "config": ConfigError("train.lr: bad")}[error]
    return "done"


async def _run_count(flow_run_id):
    async with get_client() as client:
        (task_run,) = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
    return task_run.run_count, task_run.state.type.value


def _run(error):
    attempts.clear()

    @flow
    def once():
        return flaky(error)

    return once(return_state=True)


def test_transient_failure_is_retried(prefect_api):
    state = _run("connection")
    assert state.is_completed() and attempts == ["connection", "connection"]
    assert asyncio.run(_run_count(state.state_details.flow_run_id)) == (2, "COMPLETED")


def test_bad_input_fails_at_once_with_its_message(prefect_api):
    state = _run("config")
    assert state.is_failed() and attempts == ["config"]
    assert "train.lr: bad" in state.message
    assert asyncio.run(_run_count(state.state_details.flow_run_id)) == (1, "FAILED")


def test_policy_shape():
    policy = retry_policy(2)
    assert policy["retries"] == 2 and policy["retry_delay_seconds"] == list(RETRY_DELAYS_S[:2])
    assert 0 < policy["retry_jitter_factor"] <= 1
