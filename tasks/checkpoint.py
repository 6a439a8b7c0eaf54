from prefect import task
from prefect.cache_policies import NO_CACHE

from miles.run import PolicyRun
from tasks.policy import retry_policy


@task(
    name="save_checkpoint",
    task_run_name="save_checkpoint[{run.label}rollout={rollout_id}]",
    **retry_policy(2),
    cache_policy=NO_CACHE,
)
def save_checkpoint(run: PolicyRun, rollout_id: int) -> str:
    """Write <run_dir>/checkpoints/<rollout_id>/ atomically; an existing one is kept."""
    return run.save_checkpoint(rollout_id)
