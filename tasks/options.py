"""What every task shares: the retry policy, no input cache, and the hook that counts it in the task history."""

from __future__ import annotations

import logging
import os
from typing import Any

from prefect.cache_policies import NO_CACHE

from tasks.history import count_finished
from tasks.retries import retry_policy


class RoutineTaskRunLogs(logging.Filter):
    """Drops the INFO lines a task run writes when all goes well: our history hook running and done, and "Finished in
    state Completed()", which its state in the UI already says. Each was a log row shipped to the API, three per task
    run. Warnings, errors, retries and every other line stay."""

    ROUTINE = (
        f"Running hook {count_finished.__name__!r}",
        f"Hook {count_finished.__name__!r}",
        "Finished in state Completed(",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno != logging.INFO or not record.getMessage().startswith(self.ROUTINE)


logging.getLogger("prefect.task_runs").addFilter(RoutineTaskRunLogs())


def task_options(retries: int) -> dict[str, Any]:
    """Keyword arguments for `@task`. No cache: the inputs are a run object and tables, costly to hash and never
    a reason to skip work (each call is idempotent per rollout_id instead)."""
    return {
        **retry_policy(retries),
        "cache_policy": NO_CACHE,
        "on_completion": [count_finished],
        "on_failure": [count_finished],
    }


GPU_TAG_VARIABLE = "MILES_GPU_TAG"


def gpu_tags() -> list[str]:
    """The tags of the tasks that hold the engines: MILES_GPU_TAG names one (`gpu` with `make server-postgres`), for
    a tag concurrency limit. Unset by default: each tagged task run asks the API for slots, which a SQLite database
    answers with 503s and 2 s back-offs under load (docs/benchmarks.md); PostgreSQL takes it cheaply."""
    tag = os.environ.get(GPU_TAG_VARIABLE)
    return [tag] if tag else []
