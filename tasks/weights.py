from prefect import task

from miles.multi_lora.run import AdapterRun
from miles.run import RLRun
from tasks.options import task_options


@task(name="sync_weights", task_run_name="sync_weights[{run.label}rollout={rollout_id}]", **task_options(retries=2))
def sync_weights(run: RLRun, rollout_id: int) -> int:
    """Push the weights trained on `rollout_id` to every engine; returns the new weight version."""
    return run.sync_weights(rollout_id)


@task(name="push_adapter", task_run_name="push_adapter[{run.label}rollout={rollout_id}]", **task_options(retries=2))
def push_adapter(run: AdapterRun, rollout_id: int) -> int:
    """Load the adapter trained on `rollout_id` into every engine; the other adapters are not touched."""
    return run.push_adapter(rollout_id)


@task(name="retire_adapter", task_run_name="retire_adapter[{run.name}]", **task_options(retries=2))
def retire_adapter(run: AdapterRun) -> None:
    """Unload a finished adapter from the engines and the trainer; its final checkpoint is already saved."""
    run.retire()
