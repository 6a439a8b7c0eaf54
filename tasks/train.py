import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from miles.run import PolicyRun
from tasks.policy import retry_policy


@task(
    name="train_step",
    task_run_name="train_step[{run.label}rollout={rollout_id}]",
    **retry_policy(2),
    cache_policy=NO_CACHE,
)
def train_step(run: PolicyRun, rollout_id: int, table: pa.Table) -> dict:
    """Optimizer steps on the rollout; a rollout already in the ledger returns its recorded metrics."""
    return run.train(rollout_id, table)
