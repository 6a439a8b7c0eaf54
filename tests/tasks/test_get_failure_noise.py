"""A failing `get` reports its own error, not a failed attempt to persist the exception as a result."""

import logging

from prefect import flow

from tasks.get import get


class _MissingRollout:
    label = ""

    def get(self, rollout_id: int):
        raise ValueError(f"rollout {rollout_id} is not stored")


def test_failed_get_logs_no_result_write_warning(prefect_api, caplog):
    @flow
    def hand_over():
        return get(_MissingRollout(), 1)

    with caplog.at_level(logging.WARNING):
        state = hand_over(return_state=True)

    assert state.is_failed() and "rollout 1 is not stored" in state.message
    messages = [r.getMessage() for r in caplog.records]
    assert any("rollout 1 is not stored" in m for m in messages)  # the task's own failure was captured
    assert not [m for m in messages if "Failed to write result" in m or "Failed to serialize" in m]
