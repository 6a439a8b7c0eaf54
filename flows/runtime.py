"""Where Prefect keeps its state for a run, and what every RL flow shares.

`configure_prefect` must run before the first `import prefect`: Prefect reads these settings at import.
"""

from __future__ import annotations

import os
from pathlib import Path


def configure_prefect(project_dir: Path | None = None) -> None:
    """Project-local PREFECT_HOME (an explicit one wins), no telemetry, and our library's logs in the UI."""
    os.environ.setdefault("PREFECT_HOME", str((project_dir or Path.cwd()) / ".prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "miles")
    # The terminal gets warnings and our progress lines; the API (and so the UI) still gets every INFO log.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


def drain_task_history(flow, flow_run, state) -> None:
    """On the flow run's final state: wait until the API holds its whole task history (also after a failure:
    the failed run's history is what people read)."""
    from tasks.history import wait_for_task_history

    wait_for_task_history(flow_run.id)


# `@flow(name=..., **RL_FLOW_OPTIONS)`: every RL flow leaves its whole history in the API when it ends.
RL_FLOW_OPTIONS = {
    "on_completion": [drain_task_history],
    "on_failure": [drain_task_history],
    "on_crashed": [drain_task_history],
}
