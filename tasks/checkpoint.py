from prefect import task

from miles.multi_lora import AdapterRun
from miles.run import RLRun
from tasks.events import emit_checkpoint
from tasks.options import task_options


@task(
    name="save_checkpoint", task_run_name="save_checkpoint[{run.label}rollout={rollout_id}]", **task_options(retries=2)
)
def save_checkpoint(run: RLRun | AdapterRun, rollout_id: int) -> str:
    """Write the run's checkpoints/<rollout_id>/ atomically (an existing one is kept), and emit its event."""
    path = run.save_checkpoint(rollout_id)
    if run.config.logging.events:
        emit_checkpoint(run, rollout_id, path)
    return path
