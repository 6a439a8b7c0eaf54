"""The multi-LoRA flow: N LoRA adapters on one frozen base, one branch per adapter, the branches concurrent.

    for each adapter, concurrently (Prefect futures):
        for rollout_id in its start .. num_steps - 1:
            generate(adapter, rollout_id)            # the engines batch this with the other adapters' requests
            table = get(adapter, rollout_id)
            train_step(adapter, rollout_id, table)   # this adapter's optimizer only
            push_adapter(adapter, rollout_id)        # only this adapter changes on the engines
            save_checkpoint(adapter, rollout_id)     # every save_interval and at its end: a PEFT directory
        retire_adapter(adapter)                      # saved, unloaded; the other adapters go on
        evaluate(adapter)                            # greedy accuracy of the base vs base + adapter on its task

The flow ends when every adapter has retired. Each adapter has its own directory, progress, metrics table
and summary in the UI; a run dir that holds adapter checkpoints resumes each adapter after its latest one.
"""

from __future__ import annotations

from prefect import flow
from prefect.futures import PrefectFuture, as_completed

from flows.report import RunReport
from flows.runtime import wait_for_task_history
from miles.config import RunConfig
from miles.multi_lora import AdapterRun, MultiLoRARun
from tasks import generate, get, push_adapter, retire_adapter, save_checkpoint, train_step


def submit_iteration(branch: AdapterRun, rollout_id: int) -> tuple[PrefectFuture, int]:
    """Submit one rollout of one adapter as a chain of futures; returns the chain's last future and its length."""
    generated = generate.submit(branch, rollout_id)
    table = get.submit(branch, rollout_id, wait_for=[generated])
    last = train_step.submit(branch, rollout_id, table)
    chain = [generated, table, last]
    if not branch.is_last(rollout_id):
        chain.append(last := push_adapter.submit(branch, rollout_id, wait_for=[last]))
    if branch.should_save(rollout_id):
        chain.append(last := save_checkpoint.submit(branch, rollout_id, wait_for=[last]))
    if branch.is_last(rollout_id):
        chain.append(last := retire_adapter.submit(branch, wait_for=[last]))
    return last, len(chain)


@flow(name="rl-multi-lora")
def multi_lora(config: RunConfig) -> dict:
    with MultiLoRARun(config) as run:
        reports = {b.name: RunReport(b, f"rl-multi-lora-{b.name}") for b in run.active()}
        try:
            in_flight: dict[PrefectFuture, tuple[AdapterRun, int]] = {}

            def submit(branch: AdapterRun, rollout_id: int) -> None:
                future, task_runs = submit_iteration(branch, rollout_id)
                reports[branch.name].task_runs += task_runs
                in_flight[future] = (branch, rollout_id)

            for branch in run.active():
                submit(branch, branch.rollout_ids()[0])
            while in_flight:
                future = next(as_completed(list(in_flight)))
                branch, rollout_id = in_flight.pop(future)
                future.result()  # a branch that failed past its retries fails the flow run
                reports[branch.name].iteration_done(rollout_id)
                if rollout_id + 1 < branch.rollout_ids().stop:
                    submit(branch, rollout_id + 1)
                else:
                    reports[branch.name].finish()
        finally:
            wait_for_task_history(sum(r.task_runs for r in reports.values()))
    return {name: report.summary() for name, report in reports.items()}


if __name__ == "__main__":
    from flows.runtime import configure_prefect

    configure_prefect()
    print(multi_lora(RunConfig()))
