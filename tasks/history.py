"""The task history of each flow run: finished task runs counted in this process, and a wait until the API has
stored them all.

Task-run states reach the API as events that the server stores asynchronously; an ephemeral API dies with the
process, so without the wait the UI would later show only part of the run. Every task counts itself through
`count_finished`, a state hook that `task_options` installs.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from uuid import UUID

from prefect.client.orchestration import get_client

_finished: Counter[UUID] = Counter()
_finished_lock = threading.Lock()  # concurrent task runs finish in the task runner's threads

FINISHED_STATES = ["COMPLETED", "FAILED", "CRASHED", "CANCELLED"]


def count_finished(task, task_run, state) -> None:
    """On a task run's final state (completed, or failed past its retries)."""
    with _finished_lock:
        _finished[task_run.flow_run_id] += 1


def finished_task_runs(flow_run_id: UUID | str) -> int:
    with _finished_lock:
        return _finished[UUID(str(flow_run_id))]


def wait_for_task_history(flow_run_id: UUID, timeout_s: float = 60.0) -> int:
    """Block until the API has stored every task run of `flow_run_id` that finished here; returns how many it has."""
    query = {
        "task_runs": {"state": {"type": {"any_": FINISHED_STATES}}},
        "flow_runs": {"id": {"any_": [str(flow_run_id)]}},
    }
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            stored = int(client.request("POST", "/task_runs/count", json=query).json())
            if stored >= finished_task_runs(flow_run_id) or time.monotonic() > deadline:
                return stored
            time.sleep(0.05)
