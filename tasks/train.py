import pyarrow as pa
from prefect import task

from miles.multi_lora.run import AdapterRun
from miles.run import RLRun
from tasks.options import task_options


@task(name="train_step", task_run_name="train_step[{run.label}rollout={rollout_id}]", **task_options(retries=2))
def train_step(run: RLRun | AdapterRun, rollout_id: int, table: pa.Table) -> dict:
    """Optimizer steps on the rollout; a rollout already in the ledger returns its recorded metrics."""
    return run.train(rollout_id, table)
