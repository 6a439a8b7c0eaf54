from prefect import task
from prefect.cache_policies import NO_CACHE

from miles.multi_lora import AdapterRun
from miles.run import RLRun
from tasks.policy import retry_policy


@task(
    name="sync_weights",
    task_run_name="sync_weights[{run.label}rollout={rollout_id}]",
    **retry_policy(2),
    cache_policy=NO_CACHE,
)
def sync_weights(run: RLRun, rollout_id: int) -> int:
    """Push the weights trained on `rollout_id` to every engine; returns the new weight version."""
    return run.sync_weights(rollout_id)


@task(
    name="push_adapter",
    task_run_name="push_adapter[{run.label}rollout={rollout_id}]",
    **retry_policy(2),
    cache_policy=NO_CACHE,
)
def push_adapter(run: AdapterRun, rollout_id: int) -> int:
    """Load the adapter trained on `rollout_id` into every engine; the other adapters are not touched."""
    return run.push_adapter(rollout_id)


@task(name="retire_adapter", task_run_name="retire_adapter[{run.name}]", **retry_policy(2), cache_policy=NO_CACHE)
def retire_adapter(run: AdapterRun) -> None:
    """Unload a finished adapter from the engines and the trainer; its final checkpoint is already saved."""
    run.retire()
