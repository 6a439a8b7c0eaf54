import pyarrow as pa
from prefect import task

from miles.run import RLRun
from tasks.options import task_options


@task(name="compute_values", task_run_name="compute_values[rollout={rollout_id}]", **task_options(retries=2))
def compute_values(run: RLRun, rollout_id: int) -> None:
    """The critic's values of the rollout's tokens, stored beside it; a rollout whose values are stored keeps them."""
    run.compute_values(rollout_id)


@task(name="train_critic", task_run_name="train_critic[rollout={rollout_id}]", **task_options(retries=2))
def train_critic(run: RLRun, rollout_id: int, table: pa.Table) -> dict:
    """The critic's optimizer steps on the rollout; a rollout already in the critic's ledger returns its metrics."""
    return run.train_critic(rollout_id, table)
