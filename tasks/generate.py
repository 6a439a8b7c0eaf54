from prefect import task
from prefect.cache_policies import NO_CACHE

from miles.run import PolicyRun
from tasks.policy import retry_policy

# No tags: in Prefect 3.9 every tagged task run asks the API for concurrency slots of its tags, and a SQLite
# API answers that call 503 under load, which the client retries after 2 s. Measured on 2 cores: the `gpu`
# tag took the flow/plain-loop ratio from 1.32 to 1.71 and delayed the async flow's next generation past the
# train step it should overlap. With a Postgres-backed server, `generate.with_options(tags=["gpu"])` and
# `prefect concurrency-limit create gpu N` limit GPU work without that cost.


@task(
    name="generate",
    task_run_name="generate[{run.label}rollout={rollout_id}]",
    **retry_policy(2),
    cache_policy=NO_CACHE,
)
def generate(run: PolicyRun, rollout_id: int) -> dict:
    """Sample, score and store rollout `rollout_id` (a stored rollout is reused, never regenerated)."""
    return run.generate(rollout_id)
