from prefect import task
from prefect.artifacts import create_table_artifact

from miles.multi_lora.run import AdapterRun
from miles.run import RLRun
from tasks.artifacts import table_rows
from tasks.options import task_options

EVAL_TABLE_COLUMNS = ("rollout_id", "weight_version", "reward_mean", "samples", "failed_samples", "truncated_fraction")


@task(name="evaluate", task_run_name="evaluate[{run.label}rollout={rollout_id}]", **task_options(retries=2))
def evaluate(run: RLRun | AdapterRun, rollout_id: int) -> list[dict]:
    """Evaluate the weights the engines hold on every eval data set (once per rollout_id); each data set's table of
    its evaluations so far is an artifact."""
    records = run.evaluate(rollout_id)
    for record in records:
        rows = table_rows(run.run_dir.evaluations(record["eval"]), _shown)
        create_table_artifact(
            key="-".join(filter(None, ["eval", record.get("adapter"), record["eval"]])),
            table=[{**row, "checkpoint": _evaluated_checkpoint(run, row["rollout_id"])} for row in rows],
            description=f"evaluations of {record['eval']} in {run.config.run_dir}",
        )
    return records


def _evaluated_checkpoint(run: RLRun | AdapterRun, rollout_id: int) -> str:
    """The checkpoint whose weights an evaluation at `rollout_id` read (`miles lineage` tells what made it)."""
    if rollout_id == 0:
        return "the starting model"
    checkpoint = run.run_dir.checkpoint(rollout_id - 1)
    return str(checkpoint) if checkpoint.is_dir() else f"not saved (rollout {rollout_id - 1})"


def _shown(key: str) -> bool:
    return key in EVAL_TABLE_COLUMNS or key.startswith("pass_at_")
