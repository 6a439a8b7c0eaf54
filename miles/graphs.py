"""The flow graphs by name, one record each, used by the plain loops (miles.loop), the Prefect flows (flows/), the
`miles` CLI and the deployments: the graph's schedule (miles.schedules; its docstring is the graph's algorithm box,
the Prefect flow's description), the run it drives, and the checks that reject a config it cannot run."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from miles import schedules
from miles.config import RunConfig
from miles.multi_lora.inputs import check_adapter_inputs
from miles.multi_lora.run import MultiLoRARun
from miles.multi_lora.schedule import multi_lora as multi_lora_schedule
from miles.run import RLRun, check_fully_async, check_off_policy_correction, check_run
from miles.schedules import Steps


@dataclass(frozen=True)
class Graph:
    name: str  # `miles run <name>`, the Prefect flow rl-<name>, its deployments rl-<name>/<config>
    schedule: Callable[[Any, Steps], Iterator[Any]]
    run: type[RLRun] | type[MultiLoRARun]
    own_checks: tuple[Callable[[RunConfig], object], ...]  # what this graph cannot run, whatever the run can
    run_check: Callable[[RunConfig], object]  # everything the run checks at its start, before any work

    @property
    def flow_name(self) -> str:
        return f"rl-{self.name}"

    @property
    def algorithm_box(self) -> str:
        return inspect.getdoc(self.schedule)

    def check_graph(self, config: RunConfig) -> None:
        """The graph's own checks (a flow and a loop run them before the run, which checks the rest at its start)."""
        for check in self.own_checks:
            check(config)

    def check(self, config: RunConfig) -> None:
        """Everything that rejects `config` for this graph, before any work (the CLI's, before Prefect starts)."""
        self.check_graph(config)
        self.run_check(config)


GRAPHS = {
    graph.name: graph
    for graph in (
        Graph("sync", schedules.sync, RLRun, (), check_run),
        Graph("async", schedules.one_step_off_policy, RLRun, (check_off_policy_correction,), check_run),
        Graph("fully-async", schedules.fully_async, RLRun, (check_fully_async,), check_run),
        Graph("multi-lora", multi_lora_schedule, MultiLoRARun, (), check_adapter_inputs),
    )
}
