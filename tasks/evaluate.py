from prefect import task

from miles.multi_lora import AdapterRun
from miles.run import RLRun
from tasks.options import task_options


@task(name="evaluate", task_run_name="evaluate[{run.label}rollout={rollout_id}]", **task_options(retries=1))
def evaluate(run: RLRun | AdapterRun, rollout_id: int) -> dict:
    """Greedy accuracy of the starting model and of checkpoint `rollout_id` on the same held-out prompts."""
    return run.evaluate(rollout_id)
