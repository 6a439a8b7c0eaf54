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

The schedule is written once, `miles.schedules.one_step_off_policy`, over the tasks; `miles.loop.run_async` runs it without Prefect.
"""

from __future__ import annotations

from prefect import flow
from prefect.client.schemas.objects import State

from flows.control import FlowRunControl
from flows.report import RunReport
from flows.runtime import check_deployment_run
from miles import schedules
from miles.config import RunConfig
from miles.run import RLRun, check_off_policy_correction
from tasks import STEPS


@flow(name="rl-async")
def async_rl(config: RunConfig) -> dict | State:
    check_deployment_run(config)
    check_off_policy_correction(config)
    with FlowRunControl() as control, RLRun(config) as run, RunReport(run, "rl-async") as report:
        for rollout_id in schedules.one_step_off_policy(run, control.steps(STEPS)):
            report.iteration_done(rollout_id)
    return control.end(report.summary())
