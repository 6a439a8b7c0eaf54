"""The rl-async flow: the async graph's schedule (miles.schedules, its algorithm box the flow's description) over the
Prefect tasks; `miles.loop` runs the same schedule without Prefect."""

from __future__ import annotations

from prefect import flow
from prefect.client.schemas.objects import State

from flows.graph_flow import run_policy_flow
from miles.config import RunConfig
from miles.graphs import GRAPHS

GRAPH = GRAPHS["async"]


@flow(name=GRAPH.flow_name, description=GRAPH.algorithm_box)
def async_rl(config: RunConfig) -> dict | State:
    return run_policy_flow(GRAPH, config)
