"""The task history of each flow run: finished task runs counted in this process, and a wait until the API has
stored them all.

Task-run states reach the API as events that the server stores asynchronously (in batches, at least once a second).
A Prefect server of its own keeps storing them after this process ends; the embedded API dies with this process, so
before it stops, the process waits until it has stored every task run counted here. That wait comes once, at exit,
not at each flow run's end. Every task counts itself through `count_finished`, a state hook that `task_options`
installs.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL

logger = logging.getLogger(__name__)

_finished: Counter[UUID] = Counter()
_finished_lock = threading.Lock()  # concurrent task runs finish in the task runner's threads
_exit_wait_decided = False  # whether this process owns its API is settled by its first task run

FINISHED_STATES = ["COMPLETED", "FAILED", "CRASHED", "CANCELLED"]


def count_finished(task, task_run, state) -> None:
    """On a task run's final state (completed, or failed past its retries)."""
    global _exit_wait_decided
    with _finished_lock:
        _finished[task_run.flow_run_id] += 1
        if not _exit_wait_decided:
            _exit_wait_decided = True
            if not PREFECT_API_URL.value():
                # Prefect registered the embedded API's stop when it started it, before this first task run ended;
                # exit hooks run last-registered first, after Prefect's event and log workers sent what they hold.
                atexit.register(wait_for_task_history)


def finished_task_runs(flow_run_id: UUID | str) -> int:
    with _finished_lock:
        return _finished[UUID(str(flow_run_id))]


def wait_for_task_history(flow_run_ids: Iterable[UUID | str] | None = None, timeout_s: float = 60.0) -> int:
    """Block until the API has stored every task run of `flow_run_ids` (all flow runs counted here by default) that
    finished in this process; returns how many it has, and warns when the timeout leaves some out."""
    with _finished_lock:
        ids = [UUID(str(i)) for i in flow_run_ids] if flow_run_ids is not None else list(_finished)
        expected = sum(_finished[i] for i in ids)
    if not ids:
        return 0
    query = {
        "task_runs": {"state": {"type": {"any_": FINISHED_STATES}}},
        "flow_runs": {"id": {"any_": [str(i) for i in ids]}},
    }
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            stored = int(client.request("POST", "/task_runs/count", json=query).json())
            if stored >= expected:
                return stored
            if time.monotonic() > deadline:
                logger.warning("The API stored %d of the %d finished task runs in %.0f s", stored, expected, timeout_s)
                return stored
            time.sleep(0.05)
