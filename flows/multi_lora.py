"""The multi-LoRA flow: N LoRA adapters on one frozen base, the adapters trained concurrently.

    for each adapter, concurrently (Prefect futures):
        for rollout_id in its start .. num_steps - 1:
            evaluate(adapter, rollout_id)            # when due (its eval.*), beside its generation
            generate(adapter, rollout_id)            # the engines batch this with the other adapters' requests
            table = get(adapter, rollout_id)
            train_step(adapter, rollout_id, table)   # this adapter's optimizer only
            push_adapter(adapter, rollout_id)        # only this adapter changes on the engines (after its evaluation)
            save_checkpoint(adapter, rollout_id)     # every save_interval and at its end: a PEFT directory
        evaluate(adapter, num_steps)                 # its final weights
        retire_adapter(adapter)                      # after its last step: unloaded; the other adapters go on

An adapter's final rollout is pushed only for its final evaluation. Each adapter has its own directory, progress,
metrics table and summary in the UI; a run dir that holds adapter checkpoints resumes each adapter after its
latest one.

The schedule is written once, `miles.schedules.multi_lora`, over the tasks; `miles.loop.run_multi_lora` runs it without Prefect.
"""

from __future__ import annotations

from prefect import flow

from flows.report import RunReport
from flows.runtime import check_deployment_run
from miles import schedules
from miles.config import RunConfig
from miles.multi_lora import MultiLoRARun
from tasks import STEPS


@flow(name="rl-multi-lora")
def multi_lora(config: RunConfig) -> dict:
    check_deployment_run(config)
    with MultiLoRARun(config) as run:
        adapters = run.active()
        reports = {adapter.name: RunReport(adapter, f"rl-multi-lora-{adapter.name}") for adapter in adapters}
        for adapter, rollout_id in schedules.multi_lora(adapters, STEPS):
            reports[adapter.name].iteration_done(rollout_id)
        for adapter in adapters:
            reports[adapter.name].finish()
    return {name: report.summary() for name, report in reports.items()}
