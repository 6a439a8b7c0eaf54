"""What every task shares: the retry policy, no input cache, and the hook that counts it in the task history."""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import NO_CACHE

from tasks.history import count_finished
from tasks.retries import retry_policy


def task_options(retries: int) -> dict[str, Any]:
    """Keyword arguments for `@task`. No cache: the inputs are a run object and tables, costly to hash and never
    a reason to skip work (each call is idempotent per rollout_id instead)."""
    return {
        **retry_policy(retries),
        "cache_policy": NO_CACHE,
        "on_completion": [count_finished],
        "on_failure": [count_finished],
    }
