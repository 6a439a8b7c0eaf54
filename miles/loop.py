"""The RL loops in plain Python: each flow graph's schedule (miles.graphs) over steps that call the run here,
without Prefect. A submitted step runs on a thread of this process, as a Prefect task runs on the flow's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from miles.config import RunConfig
from miles.graphs import GRAPHS
from miles.schedules import Steps

# Threads for submitted steps: a chain waiting on its upstream holds one, as a Prefect task runner's worker does.
STEP_THREADS = 16


class PlainStep:
    """A step run in this process: `call(run, *args)` once the futures in `wait_for` are done (an upstream
    failure is raised here, as a Prefect task's upstream failure stops it); a future among the arguments is its
    result, as Prefect resolves one among a task's arguments."""

    def __init__(self, call: Callable[..., Any], threads: ThreadPoolExecutor):
        self.call = call
        self.threads = threads

    def __call__(self, run: Any, *args: Any, wait_for: list | None = None) -> Any:
        for upstream in wait_for or ():
            upstream.result()
        return self.call(run, *(arg.result() if isinstance(arg, Future) else arg for arg in args))

    def submit(self, run: Any, *args: Any, wait_for: list | None = None) -> Future:
        return self.threads.submit(self, run, *args, wait_for=wait_for)


@contextmanager
def plain_steps() -> Iterator[Steps]:
    """Every step as the run's own call; submitted steps run on threads that end with the block."""
    with ThreadPoolExecutor(STEP_THREADS, thread_name_prefix="step") as threads:
        yield Steps(
            evaluate=PlainStep(lambda run, rollout_id: run.evaluate(rollout_id), threads),
            generate=PlainStep(lambda run, rollout_id: run.generate(rollout_id), threads),
            get=PlainStep(lambda run, rollout_id: run.get(rollout_id), threads),
            train_step=PlainStep(lambda run, rollout_id, table: run.train(rollout_id, table), threads),
            compute_values=PlainStep(lambda run, rollout_id: run.compute_values(rollout_id), threads),
            train_critic=PlainStep(lambda run, rollout_id, table: run.train_critic(rollout_id, table), threads),
            sync_weights=PlainStep(lambda run, rollout_id: run.sync_weights(rollout_id), threads),
            save_checkpoint=PlainStep(lambda run, rollout_id: run.save_checkpoint(rollout_id), threads),
            push_adapter=PlainStep(lambda run, rollout_id: run.push_adapter(rollout_id), threads),
            retire_adapter=PlainStep(lambda run: run.retire(), threads),
        )


def run_graph(name: str, config: RunConfig) -> list[dict[str, Any]]:
    """A single-policy graph (sync, async, fully-async) over the plain steps: each iteration's record."""
    graph = GRAPHS[name]
    graph.check_graph(config)
    with graph.run(config) as run, plain_steps() as steps:
        return [run.finish_iteration(rollout_id) for rollout_id in graph.schedule(run, steps)]


def run_sync(config: RunConfig) -> list[dict[str, Any]]:
    return run_graph("sync", config)


def run_async(config: RunConfig) -> list[dict[str, Any]]:
    return run_graph("async", config)


def run_fully_async(config: RunConfig) -> list[dict[str, Any]]:
    return run_graph("fully-async", config)


def run_multi_lora(config: RunConfig) -> dict[str, list[dict[str, Any]]]:
    """Every adapter's records of this run; AdaptersFailed at the end when an adapter's branch failed."""
    graph = GRAPHS["multi-lora"]
    graph.check_graph(config)
    with graph.run(config) as run, plain_steps() as steps:
        records: dict[str, list[dict[str, Any]]] = {}
        for adapter, rollout_id in graph.schedule(run, steps):
            records.setdefault(adapter.name, []).append(adapter.finish_iteration(rollout_id))
        run.check_failures()
        return records
