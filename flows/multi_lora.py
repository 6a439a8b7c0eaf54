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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prefect import flow
from prefect.futures import PrefectFuture, as_completed

from flows.report import RunReport
from flows.runtime import check_deployment_imports
from miles.config import RunConfig
from miles.multi_lora import AdapterRun, MultiLoRARun
from tasks import evaluate, generate, get, push_adapter, retire_adapter, save_checkpoint, train_step


@flow(name="rl-multi-lora")
def multi_lora(config: RunConfig) -> dict:
    check_deployment_imports(config)
    with MultiLoRARun(config) as run:
        adapters = run.active()
        reports = {adapter.name: RunReport(adapter, f"rl-multi-lora-{adapter.name}") for adapter in adapters}
        for adapter, rollout_id in concurrently(adapters, submit_iteration):
            reports[adapter.name].iteration_done(rollout_id)
        for adapter in adapters:
            reports[adapter.name].finish()
    return {name: report.summary() for name, report in reports.items()}


def submit_iteration(adapter: AdapterRun, rollout_id: int) -> PrefectFuture:
    """One rollout of one adapter as a chain of futures; returns the chain's last future."""
    evaluation = evaluate.submit(adapter, rollout_id) if adapter.should_evaluate(rollout_id) else None
    generated = generate.submit(adapter, rollout_id)
    table = get.submit(adapter, rollout_id, wait_for=[generated])
    last = train_step.submit(adapter, rollout_id, table)
    # The adapter changes on the engines, and the chain ends, only after its evaluation.
    evaluated = [evaluation] if evaluation is not None else []
    if adapter.should_push(rollout_id):
        last = push_adapter.submit(adapter, rollout_id, wait_for=[last, *evaluated])
    if adapter.should_save(rollout_id):
        last = save_checkpoint.submit(adapter, rollout_id, wait_for=[last, *evaluated])
    if adapter.is_last(rollout_id):
        if adapter.should_evaluate(rollout_id + 1):
            last = evaluate.submit(adapter, rollout_id + 1, wait_for=[last])
        last = retire_adapter.submit(adapter, wait_for=[last, *evaluated])
    return last


def concurrently(
    adapters: list[AdapterRun], submit: Callable[[AdapterRun, int], PrefectFuture]
) -> Iterator[tuple[AdapterRun, int]]:
    """Each adapter's rollouts in order, the adapters side by side: an adapter's next rollout is submitted when its
    previous one ends. Yields (adapter, rollout_id) as each ends; a chain that failed past its retries raises."""
    in_flight = {
        submit(adapter, adapter.rollout_ids().start): (adapter, adapter.rollout_ids().start) for adapter in adapters
    }
    while in_flight:
        future = next(as_completed(list(in_flight)))
        adapter, rollout_id = in_flight.pop(future)
        future.result()
        yield adapter, rollout_id
        if rollout_id + 1 in adapter.rollout_ids():
            in_flight[submit(adapter, rollout_id + 1)] = (adapter, rollout_id + 1)


if __name__ == "__main__":
    from flows.runtime import configure_prefect

    configure_prefect()
    print(multi_lora(RunConfig()))
