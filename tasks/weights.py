from prefect import task
from prefect.cache_policies import NO_CACHE

from miles.run import RLRun
from tasks.policy import retry_policy


@task(
    name="sync_weights",
    task_run_name="sync_weights[rollout={rollout_id}]",
    **retry_policy(2),
    cache_policy=NO_CACHE,
)
def sync_weights(run: RLRun, rollout_id: int) -> int:
    """Push the weights trained on `rollout_id` to every engine; returns the new weight version."""
    return run.sync_weights(rollout_id)
