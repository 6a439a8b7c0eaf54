"""The fully-async RL flow: generation runs ahead of training by up to rollout.max_rollouts_in_flight rollouts, and
weight pushes land in the middle of generations.

    W = rollout.max_rollouts_in_flight
    evaluation = evaluate.submit(start)                        # when due (eval.*)
    in_flight = {i: generate.submit(i) for i in start .. start + W - 1}
    for rollout_id in start .. num_rollout - 1:
        table = get(rollout_id, wait_for=[in_flight.pop(rollout_id)])   # oldest first; groups with a token staler
                                                               # than rollout.max_weight_staleness are dropped
        in_flight[rollout_id + W] = generate.submit(rollout_id + W)     # the window stays full
        train_step(rollout_id, table)                          # meanwhile the engines generate the next W rollouts
        sync_weights(rollout_id, wait_for=[evaluation])        # every update_weights_interval; the engines pause the
                                                               # generations in flight between two decode steps, load,
                                                               # and continue them on the new weights
        evaluation = evaluate.submit(rollout_id + 1)           # when due
        save_checkpoint(rollout_id)                            # every save_interval and at the end
    wait for evaluation

Each token records the weight version that produced it (the rollout file's weight_versions column): a sample may
span several versions, and the loss corrects each token with the engine's log-prob of it (algo.use_tis or
algo.use_rollout_logprobs). The engines batch every rollout in flight together, so a rollout's slow samples no
longer hold the engine or the trainer.

Choose it over rl-async when response lengths are long-tailed (reasoning, agents): rl-async waits for the slowest
sample of each rollout and pushes weights only between generations, one version behind; here tokens may be up to
about W versions behind, bounded by rollout.max_weight_staleness. Every generation draws one round of prompts, so
algo.dynamic_sampling is refused. The run directory is the buffer: rollouts stored but not yet trained are reused
by a resumed run, and a retried generate regenerates the same rollout id from the same prompts and seeds.

The schedule is written once, `miles.schedules.fully_async`, over the tasks; `miles.loop.run_fully_async` runs it without Prefect.
"""

from __future__ import annotations

from prefect import flow
from prefect.client.schemas.objects import State

from flows.control import FlowRunControl
from flows.report import RunReport
from flows.runtime import check_deployment_run
from miles import schedules
from miles.config import RunConfig
from miles.run import RLRun, check_fully_async
from tasks import STEPS


@flow(name="rl-fully-async")
def fully_async_rl(config: RunConfig) -> dict | State:
    check_deployment_run(config)
    check_fully_async(config)
    with FlowRunControl() as control, RLRun(config) as run, RunReport(run, "rl-fully-async") as report:
        for rollout_id in schedules.fully_async(run, control.steps(STEPS)):
            report.iteration_done(rollout_id)
    return control.end(report.summary())
