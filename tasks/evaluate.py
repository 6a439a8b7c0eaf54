from prefect import task
from prefect.cache_policies import NO_CACHE

from miles.run import PolicyRun
from tasks.policy import retry_policy


@task(name="evaluate", task_run_name="evaluate[{run.label}rollout={rollout_id}]", cache_policy=NO_CACHE, **retry_policy(1))
def evaluate(run: PolicyRun, rollout_id: int) -> dict:
    """Greedy accuracy of the starting model and of checkpoint `rollout_id` on the same held-out prompts."""
    return run.evaluate(rollout_id)
