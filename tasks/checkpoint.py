from prefect import task
from prefect.cache_policies import NO_CACHE

from miles.run import RLRun


@task(
    name="save_checkpoint",
    task_run_name="save_checkpoint[rollout={rollout_id}]",
    retries=2,
    retry_delay_seconds=1,
    cache_policy=NO_CACHE,
)
def save_checkpoint(run: RLRun, rollout_id: int) -> str:
    """Write <run_dir>/checkpoints/<rollout_id>/ atomically; an existing one is kept."""
    return run.save_checkpoint(rollout_id)
