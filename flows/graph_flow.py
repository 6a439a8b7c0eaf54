"""What every single-policy flow does: the deployment's policy, the graph's own checks, then the graph's schedule
over the Prefect tasks, under the UI's control, reported in the UI."""

from __future__ import annotations

from prefect.client.schemas.objects import State

from control.policy import check_deployment_run
from control.requests import FlowRunControl
from flows.report import RunReport
from miles.config import RunConfig
from miles.graphs import Graph
from tasks import STEPS


def run_policy_flow(graph: Graph, config: RunConfig) -> dict | State:
    check_deployment_run(config)
    graph.check_graph(config)
    with FlowRunControl() as control, graph.run(config) as run, RunReport(run, graph.flow_name) as report:
        for rollout_id in graph.schedule(run, control.steps(STEPS)):
            report.iteration_done(rollout_id)
    return control.end(report.summary())
