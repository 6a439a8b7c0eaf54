import pyarrow as pa
from prefect import task

from miles.multi_lora.run import AdapterRun
from miles.run import RLRun
from tasks.options import task_options


@task(
    name="get",
    task_run_name="get[{run.label}rollout={rollout_id}]",
    **task_options(retries=1),
    # The rollout's Arrow file in the run dir is the durable copy: no second copy of the table (or of its error)
    # in Prefect's result storage, whatever the result-persistence default.
    persist_result=False,
)
def get(run: RLRun | AdapterRun, rollout_id: int) -> pa.Table:
    """Hand over the stored rollout as a pyarrow.Table with advantages, trimmed to whole global batches."""
    return run.get(rollout_id)
