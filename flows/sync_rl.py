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
"""

from __future__ import annotations

from prefect import flow

from flows.report import RunReport
from flows.runtime import check_deployment_imports
from miles.config import RunConfig
from miles.run import RLRun
from tasks import evaluate, generate, get, save_checkpoint, sync_weights, train_step


@flow(name="rl-sync")
def sync_rl(config: RunConfig) -> dict:
    check_deployment_imports(config)
    with RLRun(config) as run:
        report = RunReport(run, "rl-sync")
        for rollout_id in run.rollout_ids():
            if run.should_evaluate(rollout_id):
                evaluate(run, rollout_id)
            generate(run, rollout_id)
            table = get(run, rollout_id)
            train_step(run, rollout_id, table)
            if run.should_sync(rollout_id):
                sync_weights(run, rollout_id)
            if run.should_save(rollout_id):
                save_checkpoint(run, rollout_id)
            report.iteration_done(rollout_id)
        if run.should_evaluate(run.rollout_ids().stop):
            evaluate(run, run.rollout_ids().stop)
        if run.rollout_ids():
            report.finish()
    return report.summary()


if __name__ == "__main__":
    from flows.runtime import configure_prefect

    configure_prefect()
    print(sync_rl(RunConfig()))
