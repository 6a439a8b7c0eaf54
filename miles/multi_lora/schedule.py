"""The multi-LoRA run's schedule (the rl-multi-lora graph): each adapter's rollouts as a chain of steps, the adapters
side by side, and the service around them: tenants admitted as they are submitted, idle waits, withdrawals, an
adapter's failure kept to its own branch. Written over `Steps` (miles.schedules), as the other graphs are."""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator

from miles.multi_lora.run import TENANT_POLL_S, AdapterRun, MultiLoRARun
from miles.schedules import Steps

log = logging.getLogger(__name__)


def adapter_iteration(adapter: AdapterRun, steps: Steps, rollout_id: int) -> list:
    """One rollout of one adapter as a chain of futures; returns them in the order submitted, the chain's end last.
    The adapter changes on the engines, and the chain ends, only after its evaluation; after its last rollout it
    retires."""
    evaluation = steps.evaluate.submit(adapter, rollout_id) if adapter.should_evaluate(rollout_id) else None
    evaluated = [evaluation] if evaluation is not None else []
    chain = [*evaluated, steps.generate.submit(adapter, rollout_id)]
    chain.append(steps.get.submit(adapter, rollout_id, wait_for=[chain[-1]]))
    chain.append(steps.train_step.submit(adapter, rollout_id, chain[-1]))
    if adapter.should_sync(rollout_id):
        chain.append(steps.push_adapter.submit(adapter, rollout_id, wait_for=[chain[-1], *evaluated]))
    if adapter.should_save(rollout_id):
        chain.append(steps.save_checkpoint.submit(adapter, rollout_id, wait_for=[chain[-1], *evaluated]))
    if adapter.is_last(rollout_id):
        if adapter.should_evaluate(rollout_id + 1):
            chain.append(steps.evaluate.submit(adapter, rollout_id + 1, wait_for=[chain[-1]]))
        chain.append(steps.retire_adapter.submit(adapter, wait_for=[chain[-1], *evaluated]))
    return chain


def multi_lora(run: MultiLoRARun, steps: Steps) -> Iterator[tuple[AdapterRun, int]]:
    """rl-multi-lora: N LoRA adapters on one frozen base, trained concurrently, each by its trainer group (adapters of
    different groups train at the same time), and tenants that join and leave while it runs.

        for each adapter (the configured ones, and each tenant as it is submitted), concurrently (futures):
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
        an adapter whose step failed (after its retries): recorded (`run.failures`), retired; the others go on, and
            the run fails at the end, naming it
        a trainer group left without an adapter to train: stopped
        nothing left to train: wait up to tenants.idle_timeout_s for a tenant (every TENANT_POLL_S meanwhile, and
            at each boundary, the tenants submitted since are admitted)
        asked to pause or cancel: no adapter starts a rollout; with none in flight, each adapter is saved at its
            boundary, then the run holds until resumed (no form: each adapter's settings are its own), releasing the
            engines and trainer groups when asked, or ends Cancelled (`at_adapters_boundary`)

    An adapter's final rollout is pushed only for its final evaluation. Each adapter has its own directory, progress,
    metrics and summary; a run dir that holds adapter checkpoints resumes each adapter after its latest one. Yields
    (adapter, rollout_id) as each rollout ends."""
    ended: queue.SimpleQueue = queue.SimpleQueue()
    in_flight = 0

    def submit(adapter: AdapterRun, rollout_id: int) -> None:
        nonlocal in_flight
        in_flight += 1
        chain = adapter_iteration(adapter, steps, rollout_id)
        chain[-1].add_done_callback(lambda _: ended.put((chain, adapter, rollout_id)))

    def starts(adapters: list[AdapterRun]) -> list[tuple[AdapterRun, int]]:
        return [(adapter, adapter.rollout_ids().start) for adapter in adapters]

    waiting = starts(run.active())  # each adapter's next rollout, submitted unless the user asked to stop here
    while True:
        if steps.control.requested() is None:
            for adapter, rollout_id in waiting:
                submit(adapter, rollout_id)
            waiting = []
        elif not in_flight:
            if not at_adapters_boundary(run, steps, waiting):
                return
            continue
        if not in_flight:
            waiting = starts(run.wait_for_tenants(until=lambda: steps.control.requested() is not None))
            if not waiting and steps.control.requested() is None:
                return
            continue
        try:
            chain, adapter, rollout_id = ended.get(timeout=TENANT_POLL_S)
        except queue.Empty:
            waiting += starts(run.admit())
            continue
        in_flight -= 1
        waiting += starts(run.admit())
        try:
            chain[-1].result()
        except Exception:  # this adapter's branch only: the others go on
            run.fail(adapter, _first_error(chain))
            _retire_after_failure(adapter, steps)
            run.release_idle_groups()
            continue
        yield adapter, rollout_id
        if rollout_id + 1 not in adapter.rollout_ids():  # its last rollout: the chain retired it
            run.release_idle_groups()
        elif run.withdrawn(adapter):
            steps.save_checkpoint(adapter, rollout_id)
            steps.retire_adapter(adapter)
            run.release_idle_groups()
        else:
            waiting.append((adapter, rollout_id + 1))


def at_adapters_boundary(run: MultiLoRARun, steps: Steps, waiting: list[tuple[AdapterRun, int]]) -> bool:
    """multi-LoRA's at_boundary, with no rollout in flight: each adapter that waits after a rollout it trained is
    saved there, where a released or cancelled run starts again; then the run holds until resumed. False: the run stops
    here (cancelled)."""
    for adapter, next_rollout_id in waiting:
        if next_rollout_id > 0 and not adapter.should_save(next_rollout_id - 1):
            steps.save_checkpoint(adapter, next_rollout_id - 1)
    if steps.control.requested() == "cancel":
        return False
    steps.control.hold(run)
    return True


def _first_error(chain: list) -> BaseException:
    """Once every step of a failed chain has ended, the first one's own error (a step after it only says that its
    upstream failed; a Prefect task whose upstream failed ends at once, while a step beside it may still run)."""
    errors = []
    for future in chain:
        try:
            future.result()
        except Exception as exc:
            errors.append(exc)
    return errors[0]


def _retire_after_failure(adapter: AdapterRun, steps: Steps) -> None:
    """Free a failed adapter's slot on the engines and its trainer group; an actor that is gone frees it anyway."""
    try:
        steps.retire_adapter(adapter)
    except Exception as exc:
        log.warning("adapter %s: retiring after its failure failed too: %s", adapter.name, exc)
