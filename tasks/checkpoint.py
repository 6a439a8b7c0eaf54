from prefect import task
from prefect.artifacts import create_markdown_artifact

from control.events import emit_checkpoint
from miles.lineage import describe, markdown
from miles.multi_lora.run import AdapterRun
from miles.run import RLRun
from tasks.artifacts import artifact_key
from tasks.options import task_options


@task(
    name="save_checkpoint", task_run_name="save_checkpoint[{run.label}rollout={rollout_id}]", **task_options(retries=2)
)
def save_checkpoint(run: RLRun | AdapterRun, rollout_id: int) -> str:
    """Write the run's checkpoints/<rollout_id>/ atomically (an existing one is kept), and emit its event."""
    path = run.save_checkpoint(rollout_id)
    if run.config.logging.events:
        emit_checkpoint(run, rollout_id, path)
    if run.config.logging.lineage:
        lineage = describe(run.run_dir.path, rollout_id)
        create_markdown_artifact(
            key=artifact_key(run.run_dir.path.name, "lineage"),
            markdown=markdown(lineage),
            description=f"what made checkpoint {rollout_id} of {run.run_dir.path}",
        )
    return path
