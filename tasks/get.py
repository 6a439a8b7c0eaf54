import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from miles.run import PolicyRun
from tasks.policy import retry_policy
from tasks.serializers import ArrowIPCSerializer


@task(
    name="get",
    task_run_name="get[{run.label}rollout={rollout_id}]",
    **retry_policy(1),
    cache_policy=NO_CACHE,
    # The rollout's Arrow file in the run dir is the durable copy; a persisted result is never pickled.
    result_serializer=ArrowIPCSerializer(),
)
def get(run: PolicyRun, rollout_id: int) -> pa.Table:
    """Hand over the stored rollout as a pyarrow.Table with advantages, trimmed to whole global batches."""
    return run.get(rollout_id)
