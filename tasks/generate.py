from prefect import task
from prefect.cache_policies import NO_CACHE

from miles.run import RLRun


@task(
    name="generate",
    task_run_name="generate[rollout={rollout_id}]",
    tags=["gpu"],
    retries=2,
    retry_delay_seconds=1,
    cache_policy=NO_CACHE,
)
def generate(run: RLRun, rollout_id: int) -> dict:
    """Sample, score and store rollout `rollout_id` (a stored rollout is reused, never regenerated)."""
    return run.generate(rollout_id)
