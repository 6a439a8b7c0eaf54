"""The multi-LoRA flow: N LoRA adapters on one frozen base, the adapters trained concurrently, each by its trainer
group (adapters of different groups train at the same time), and tenants that join and leave while it runs.

    for each adapter (the configured ones, and each tenant as it is submitted), concurrently (Prefect futures):
        for rollout_id in its start .. num_steps - 1:
            evaluate(adapter, rollout_id)            # when due (its eval.*), beside its generation
            generate(adapter, rollout_id)            # the engines batch this with the other adapters' requests
            table = get(adapter, rollout_id)
            train_step(adapter, rollout_id, table)   # this adapter's optimizer only
            push_adapter(adapter, rollout_id)        # only this adapter changes on the engines (after its evaluation)
            save_checkpoint(adapter, rollout_id)     # every save_interval and at its end: a PEFT directory
        evaluate(adapter, num_steps)                 # its final weights
        retire_adapter(adapter)                      # after its last step: unloaded; the other adapters go on
    a withdrawn adapter: save_checkpoint, retire_adapter at its next boundary
    an adapter whose step failed (after its retries): recorded, retired; the others go on, and the flow run
        fails at the end, naming it
    nothing left to train: wait up to tenants.idle_timeout_s for a tenant
    asked to pause or cancel (flows/control.py): no adapter starts a rollout; with none in flight, each adapter is
        saved at its boundary, then the run holds until resumed (no form: each adapter's settings are its own),
        releasing the engines and trainer groups when asked, or ends Cancelled

An adapter's final rollout is pushed only for its final evaluation. Each adapter has its own directory, progress,
metrics table and summary in the UI; a run dir that holds adapter checkpoints resumes each adapter after its
latest one.

The schedule is written once, `miles.schedules.multi_lora`, over the tasks; `miles.loop.run_multi_lora` runs it without Prefect.
"""

from __future__ import annotations

from contextlib import ExitStack

from prefect import flow

from flows.control import FlowRunControl
from flows.report import RunReport
from flows.runtime import check_deployment_run
from miles import schedules
from miles.config import RunConfig
from miles.multi_lora import MultiLoRARun
from tasks import STEPS


@flow(name="rl-multi-lora")
def multi_lora(config: RunConfig) -> dict:
    check_deployment_run(config)
    with FlowRunControl() as control, MultiLoRARun(config) as run:
        reports: dict[str, RunReport] = {}
        with ExitStack() as open_reports:
            for adapter, rollout_id in schedules.multi_lora(run, control.steps(STEPS)):
                if adapter.name not in reports:
                    report = RunReport(adapter, f"rl-multi-lora-{adapter.name}")
                    reports[adapter.name] = open_reports.enter_context(report)
                reports[adapter.name].iteration_done(rollout_id)
        run.check_failures()
    return control.end({name: report.summary() for name, report in reports.items()})
