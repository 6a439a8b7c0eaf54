"""Where Prefect keeps its state for a run, and draining the task history before an ephemeral API exits.

`configure_prefect` must run before the first `import prefect`: Prefect reads these settings at import.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def configure_prefect(project_dir: Path | None = None) -> None:
    """Project-local PREFECT_HOME (an explicit one wins), no telemetry, and our library's logs in the UI."""
    os.environ.setdefault("PREFECT_HOME", str((project_dir or Path.cwd()) / ".prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "miles")
    # The terminal gets warnings and our progress lines; the API (and so the UI) still gets every INFO log.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


def wait_for_task_history(expected: int, timeout_s: float = 60.0) -> int:
    """Block until the API has stored `expected` finished task runs of the current flow run.

    Task-run states reach the API as events that the server stores asynchronously; an ephemeral API dies with
    the process, so without this wait the UI would later show only part of the run.
    """
    from prefect import runtime
    from prefect.client.orchestration import get_client

    finished = {"task_runs": {"state": {"type": {"any_": ["COMPLETED", "FAILED", "CRASHED", "CANCELLED"]}}},
                "flow_runs": {"id": {"any_": [str(runtime.flow_run.id)]}}}
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            seen = int(client.request("POST", "/task_runs/count", json=finished).json())
            if seen >= expected or time.monotonic() > deadline:
                return seen
            time.sleep(0.2)
