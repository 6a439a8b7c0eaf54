"""The sync RL flow: for each rollout_id, generate -> get -> train_step -> sync_weights (and a checkpoint when due).

    for rollout_id in start .. num_rollout - 1:
        evaluate(rollout_id)                 # when due (eval.*): the weights that generate this rollout
        generate(rollout_id)                 # engines sample, reward scores, Arrow file in the run dir
        table = get(rollout_id)              # pyarrow.Table with GRPO advantages
        train_step(rollout_id, table)        # PPO-clip optimizer steps, recorded in the ledger
        sync_weights(rollout_id)             # engines get weights version rollout_id + 1 (every update_weights_interval)
        save_checkpoint(rollout_id)          # every save_interval and at the end
    evaluate(num_rollout)                    # the final weights

A run directory that already holds checkpoints resumes after the latest one.

The schedule is written once, `miles.schedules.sync`, over the tasks; `miles.loop.run_sync` runs it without Prefect.
"""

from __future__ import annotations

from prefect import flow
from prefect.client.schemas.objects import State

from flows.control import FlowRunControl
from flows.report import RunReport
from flows.runtime import check_deployment_run
from miles import schedules
from miles.config import RunConfig
from miles.run import RLRun
from tasks import STEPS


@flow(name="rl-sync")
def sync_rl(config: RunConfig) -> dict | State:
    check_deployment_run(config)
    with FlowRunControl() as control, RLRun(config) as run, RunReport(run, "rl-sync") as report:
        for rollout_id in schedules.sync(run, control.steps(STEPS)):
            report.iteration_done(rollout_id)
    return control.end(report.summary())
