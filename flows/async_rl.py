"""The async RL flow: one step off-policy; generating rollout i+1 overlaps training on rollout i.

    evaluation = evaluate.submit(start)                           # when due (eval.*), beside the first generation
    next_rollout = generate.submit(start)
    for rollout_id in start .. num_rollout - 1:
        table = get(rollout_id, wait_for=[next_rollout])          # rollout i is stored
        next_rollout = generate.submit(rollout_id + 1)            # samples on the weights the engines have now
        train_step(rollout_id, table)                             # meanwhile the trainer steps on rollout i
        sync_weights(rollout_id, wait_for=[next_rollout, evaluation])  # never change weights mid-generation/-evaluation
        evaluation = evaluate.submit(rollout_id + 1)              # when due: weights version rollout_id + 1
        save_checkpoint(rollout_id)                               # every save_interval and at the end
    wait for evaluation

Rollout i+1 comes from weights one version behind the trainer; the loss corrects with truncated importance
sampling (algo.use_tis) or the engine's log-probs as the old policy (algo.use_rollout_logprobs), and
rollout.max_weight_staleness bounds how stale a group may be. The last rollout has no next one to generate.
An evaluation shares the engines with the generation running beside it; the engines batch them together.
"""

from __future__ import annotations

from prefect import flow

from flows.report import RunReport
from flows.runtime import check_deployment_imports
from miles.config import RunConfig
from miles.run import RLRun, check_off_policy_correction
from tasks import evaluate, generate, get, save_checkpoint, sync_weights, train_step


@flow(name="rl-async")
def async_rl(config: RunConfig) -> dict:
    check_deployment_imports(config)
    check_off_policy_correction(config)
    with RLRun(config) as run:
        report = RunReport(run, "rl-async")
        rollout_ids = run.rollout_ids()
        evaluation = evaluate.submit(run, rollout_ids.start) if run.should_evaluate(rollout_ids.start) else None
        next_rollout = generate.submit(run, rollout_ids.start) if rollout_ids else None
        for rollout_id in rollout_ids:
            table = get(run, rollout_id, wait_for=[next_rollout])
            next_rollout = generate.submit(run, rollout_id + 1) if rollout_id + 1 in rollout_ids else None
            train_step(run, rollout_id, table)
            if run.should_sync(rollout_id):
                in_flight = [future for future in (next_rollout, evaluation) if future is not None]
                sync_weights(run, rollout_id, wait_for=in_flight)
            if run.should_evaluate(rollout_id + 1):
                evaluation = evaluate.submit(run, rollout_id + 1, wait_for=[evaluation] if evaluation else None)
            if run.should_save(rollout_id):
                save_checkpoint(run, rollout_id)
            report.iteration_done(rollout_id)
        if evaluation is not None:
            evaluation.result()
        if rollout_ids:
            report.finish()
    return report.summary()


if __name__ == "__main__":
    from flows.runtime import configure_prefect

    configure_prefect()
    print(async_rl(RunConfig()))
