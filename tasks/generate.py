from prefect import task

from miles.multi_lora.run import AdapterRun
from miles.run import RLRun
from tasks.options import gpu_tags, task_options


@task(
    name="generate",
    task_run_name="generate[{run.label}rollout={rollout_id}]",
    tags=gpu_tags(),
    **task_options(retries=2),
)
def generate(run: RLRun | AdapterRun, rollout_id: int) -> dict:
    """Sample, score and store rollout `rollout_id` (a stored rollout is reused, never regenerated)."""
    return run.generate(rollout_id)
