"""The RL loops in plain Python: the same calls the Prefect flows make, without Prefect."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles.config import RunConfig
from miles.multi_lora import AdapterRun, MultiLoRARun
from miles.run import RLRun, check_fully_async


def sync_iteration(run: RLRun, rollout_id: int) -> None:
    if run.should_evaluate(rollout_id):
        run.evaluate(rollout_id)
    run.generate(rollout_id)
    table = run.get(rollout_id)
    run.train(rollout_id, table)
    if run.should_sync(rollout_id):
        run.sync_weights(rollout_id)
    if run.should_save(rollout_id):
        run.save_checkpoint(rollout_id)


def run_sync(config: RunConfig) -> list[dict[str, Any]]:
    with RLRun(config) as run:
        records = []
        for rollout_id in run.rollout_ids():
            sync_iteration(run, rollout_id)
            records.append(run.finish_iteration(rollout_id))
        if run.should_evaluate(run.rollout_ids().stop):
            run.evaluate(run.rollout_ids().stop)
        return records


def run_fully_async(config: RunConfig) -> list[dict[str, Any]]:
    check_fully_async(config)
    with RLRun(config) as run:
        return list(fully_async_iterations(run))


def fully_async_iterations(run: RLRun) -> Iterator[dict[str, Any]]:
    """flows.fully_async_rl without Prefect: up to rollout.max_rollouts_in_flight generations run ahead (threads),
    pushes land while they run. Yields each iteration's record."""
    window = run.config.rollout.max_rollouts_in_flight
    rollout_ids = run.rollout_ids()
    with ThreadPoolExecutor(window + 1, thread_name_prefix="rollout") as threads:
        evaluation = threads.submit(run.evaluate, rollout_ids.start) if run.should_evaluate(rollout_ids.start) else None
        in_flight = {i: threads.submit(run.generate, i) for i in rollout_ids[:window]}
        for rollout_id in rollout_ids:
            in_flight.pop(rollout_id).result()
            table = run.get(rollout_id)
            if rollout_id + window in rollout_ids:
                in_flight[rollout_id + window] = threads.submit(run.generate, rollout_id + window)
            run.train(rollout_id, table)
            if run.should_sync(rollout_id):
                if evaluation is not None:
                    evaluation.result()  # an evaluation sees one version of the weights
                run.sync_weights(rollout_id)
            if run.should_evaluate(rollout_id + 1):
                evaluation = threads.submit(run.evaluate, rollout_id + 1)
            if run.should_save(rollout_id):
                run.save_checkpoint(rollout_id)
            yield run.finish_iteration(rollout_id)
        if evaluation is not None:
            evaluation.result()


def adapter_iteration(adapter: AdapterRun, rollout_id: int) -> None:
    """One rollout of one adapter; after its last rollout (and final evaluation) it retires."""
    if adapter.should_evaluate(rollout_id):
        adapter.evaluate(rollout_id)
    adapter.generate(rollout_id)
    table = adapter.get(rollout_id)
    adapter.train(rollout_id, table)
    if adapter.should_push(rollout_id):
        adapter.push_adapter(rollout_id)
    if adapter.should_save(rollout_id):
        adapter.save_checkpoint(rollout_id)
    if adapter.is_last(rollout_id):
        if adapter.should_evaluate(rollout_id + 1):
            adapter.evaluate(rollout_id + 1)
        adapter.retire()


def run_multi_lora(config: RunConfig) -> dict[str, list[dict[str, Any]]]:
    """The adapters take turns, one rollout each, until every adapter has trained its rollouts."""
    with MultiLoRARun(config) as run:
        records: dict[str, list[dict[str, Any]]] = {name: [] for name in run.adapters}
        pending = {adapter.name: list(adapter.rollout_ids()) for adapter in run.active()}
        while any(pending.values()):
            for name, rollout_ids in pending.items():
                if rollout_ids:
                    rollout_id = rollout_ids.pop(0)
                    adapter_iteration(run.adapters[name], rollout_id)
                    records[name].append(run.adapters[name].finish_iteration(rollout_id))
        return records
