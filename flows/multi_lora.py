"""The rl-multi-lora flow: the multi-LoRA graph's schedule (miles.schedules, its algorithm box the flow's
description) over the Prefect tasks, a report per adapter; `miles.loop` runs the same schedule without Prefect."""

from __future__ import annotations

from contextlib import ExitStack

from prefect import flow

from control.policy import check_deployment_run
from control.requests import FlowRunControl
from flows.report import RunReport
from miles.config import RunConfig
from miles.graphs import GRAPHS
from tasks import STEPS

GRAPH = GRAPHS["multi-lora"]


@flow(name=GRAPH.flow_name, description=GRAPH.algorithm_box)
def multi_lora(config: RunConfig) -> dict:
    check_deployment_run(config)
    GRAPH.check_graph(config)
    with FlowRunControl() as control, GRAPH.run(config) as run:
        reports: dict[str, RunReport] = {}
        with ExitStack() as open_reports:
            for adapter, rollout_id in GRAPH.schedule(run, control.steps(STEPS)):
                if adapter.name not in reports:
                    report = RunReport(adapter, f"{GRAPH.flow_name}-{adapter.name}")
                    reports[adapter.name] = open_reports.enter_context(report)
                reports[adapter.name].iteration_done(rollout_id)
        run.check_failures()
    return control.end({name: report.summary() for name, report in reports.items()})
