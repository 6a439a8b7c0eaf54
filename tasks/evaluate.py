from prefect import task
from prefect.artifacts import create_table_artifact

from miles.multi_lora import AdapterRun
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
        create_table_artifact(
            key="-".join(filter(None, ["eval", record.get("adapter"), record["eval"]])),
            table=table_rows(run.run_dir.evaluations(record["eval"]), _shown),
            description=f"evaluations of {record['eval']} in {run.config.run_dir}",
        )
    return records


def _shown(key: str) -> bool:
    return key in EVAL_TABLE_COLUMNS or key.startswith("pass_at_")
