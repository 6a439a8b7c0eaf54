"""The graph records (miles.graphs): each name's Prefect flow, its checks, and an algorithm box that names exactly
the steps its schedule runs."""

import re
from concurrent.futures import Future
from dataclasses import fields
from types import SimpleNamespace

import pytest

from flows.registry import FLOWS
from miles.config import ConfigError, load_config
from miles.graphs import GRAPHS
from miles.schedules import Steps


def test_each_graph_has_its_prefect_flow_described_by_its_algorithm_box():
    assert list(GRAPHS) == ["sync", "async", "fully-async", "multi-lora"]
    assert list(FLOWS) == list(GRAPHS)
    for name, graph in GRAPHS.items():
        assert FLOWS[name].name == graph.flow_name == f"rl-{name}"
        assert FLOWS[name].description == graph.algorithm_box


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("async", ["algo.use_tis=false"], "the async flows train off-policy"),
        ("fully-async", ["algo.use_tis=false"], "the async flows train off-policy"),
        ("fully-async", ["algo.dynamic_sampling=true"], "algo.dynamic_sampling: the fully-async flow"),
        ("multi-lora", ["model.path=/models/base"], "the multi-LoRA flow needs at least one adapter"),
        ("sync", ["model.path=/m", "data.task=null", "data.path=/no/such/prompts.jsonl"], "/no/such/prompts.jsonl"),
    ],
)
def test_each_graph_rejects_what_it_cannot_run_before_any_work(name, overrides, message):
    with pytest.raises(ConfigError, match=message):
        GRAPHS[name].check(load_config(None, overrides))
    GRAPHS["sync"].check(load_config(None))  # the default config runs


class RecordedStep:
    """A step that records its name and returns at once (a submitted one: a done future)."""

    def __init__(self, name: str, called: set[str]):
        self.name, self.called = name, called

    def __call__(self, run, *args, wait_for=None):
        self.called.add(self.name)

    def submit(self, run, *args, wait_for=None) -> Future:
        self(run, *args)
        future = Future()
        future.set_result(None)
        return future


class TracedPolicy:
    """Three rollouts with everything due, a critic, and a window of two generations."""

    name = "traced"
    config = SimpleNamespace(rollout=SimpleNamespace(max_rollouts_in_flight=2))
    algorithm = SimpleNamespace(needs_critic=True)

    def rollout_ids(self) -> range:
        return range(3)

    def should_evaluate(self, rollout_id: int) -> bool:
        return True

    should_sync = should_save = should_evaluate

    def is_last(self, rollout_id: int) -> bool:
        return rollout_id == 2

    def release_engine_memory(self, rollout_id: int) -> None:
        pass


class TracedMultiLoRARun:
    """One adapter, no tenants."""

    def __init__(self):
        self.adapters = [TracedPolicy()]

    def active(self) -> list:
        adapters, self.adapters = self.adapters, []
        return adapters

    def admit(self) -> list:
        return []

    def wait_for_tenants(self, until) -> list:
        return []

    def withdrawn(self, adapter) -> bool:
        return False

    def release_idle_groups(self) -> None:
        pass


@pytest.mark.parametrize("name", list(GRAPHS))
def test_the_algorithm_box_names_every_step_the_schedule_runs_and_no_other(name):
    graph = GRAPHS[name]
    called: set[str] = set()
    steps = Steps(
        **{field.name: RecordedStep(field.name, called) for field in fields(Steps) if field.name != "control"}
    )
    run = TracedMultiLoRARun() if name == "multi-lora" else TracedPolicy()
    assert list(graph.schedule(run, steps))  # it ran its iterations
    named = set(re.findall(r"\b(\w+)(?:\.submit)?\(", graph.algorithm_box)) & {field.name for field in fields(Steps)}
    assert named == called
