"""Each flow graph's schedule, written once: which steps run for each rollout, in what order, and what runs beside
what. A schedule runs over `Steps`: the Prefect tasks (the flows in flows/) or the plain steps (miles.loop), so a
flow and its plain loop are one schedule, and give the same rollouts and weights.

A step is called as `step(run, *args, wait_for=[...])`, which runs it once the futures in `wait_for` are done and
returns its result, or submitted as `step.submit(run, *args, wait_for=[...])`, which returns a future (`result()`,
`add_done_callback(fn)`). Each schedule is a generator: it yields a policy's rollout_id when that iteration is done
(the single-policy graphs yield the rollout_id, the multi-LoRA graph `(adapter, rollout_id)`), and the caller
finishes the iteration (its metrics line, its row in the UI).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from miles.multi_lora import TENANT_POLL_S, AdapterRun, MultiLoRARun
from miles.run import RLRun

log = logging.getLogger(__name__)


class Step(Protocol):
    def __call__(self, run: Any, *args: Any, wait_for: list | None = None) -> Any: ...

    def submit(self, run: Any, *args: Any, wait_for: list | None = None) -> Any: ...


class Control(Protocol):
    """What a user asks of a running schedule, which it does at the next iteration boundary, with nothing in flight
    (flows/control.py: the Prefect UI, API and automations)."""

    def requested(self) -> Literal["pause", "cancel"] | None: ...

    def pause(self, run: Any, next_rollout_id: int) -> None:
        """Wait until the user resumes the run; apply what they changed meanwhile (`run.change_config`)."""

    def hold(self, run: MultiLoRARun) -> None:
        """Wait until the user resumes the multi-LoRA run, changing nothing: each adapter's settings are its own."""


class NoControl:
    """A schedule nobody pauses or cancels (the plain loops)."""

    def requested(self) -> None:
        return None

    def pause(self, run: Any, next_rollout_id: int) -> None:
        raise AssertionError("nothing requested a pause")

    def hold(self, run: MultiLoRARun) -> None:
        raise AssertionError("nothing requested a pause")


@dataclass(frozen=True)
class Steps:
    """The steps of every graph; each is one call into the run (RLRun or AdapterRun) of the same name; `control`
    says what the user asks between two iterations."""

    evaluate: Step
    generate: Step
    get: Step
    train_step: Step
    compute_values: Step
    train_critic: Step
    sync_weights: Step
    save_checkpoint: Step
    push_adapter: Step
    retire_adapter: Step
    control: Control = NoControl()


def sync_iteration(run: RLRun, steps: Steps, rollout_id: int) -> None:
    """One iteration of the rl-sync graph: evaluate (when due) -> generate -> get -> train -> sync -> save; with a
    critic, generate -> compute_values -> get (GAE) -> train -> train_critic. Colocated, the engines release their
    memory before the train step and take it back with the push."""
    if run.should_evaluate(rollout_id):
        steps.evaluate(run, rollout_id)
    steps.generate(run, rollout_id)
    table = handed_over(run, steps, rollout_id, [])
    run.release_engine_memory(rollout_id)  # colocated: no generation until the push, so the trainer takes the GPU
    train(run, steps, rollout_id, table)
    if run.should_sync(rollout_id):
        steps.sync_weights(run, rollout_id)
    if run.should_save(rollout_id):
        steps.save_checkpoint(run, rollout_id)


def handed_over(run: RLRun, steps: Steps, rollout_id: int, generated: list) -> Any:
    """The rollout's table from `get` once its generation (`generated`: its future, if any) is done; with a critic
    (algo.advantage_estimator=gae) the critic's values of its tokens come first, since GAE needs them."""
    if run.algorithm.needs_critic:
        steps.compute_values(run, rollout_id, wait_for=generated)
        generated = []
    return steps.get(run, rollout_id, wait_for=generated)


def train(run: RLRun, steps: Steps, rollout_id: int, table: Any) -> None:
    """The policy's optimizer steps on the rollout, then the critic's (with one)."""
    steps.train_step(run, rollout_id, table)
    if run.algorithm.needs_critic:
        steps.train_critic(run, rollout_id, table)


def sync(run: RLRun, steps: Steps) -> Iterator[int]:
    """rl-sync: the iterations one after another, then the evaluation of the final weights."""
    rollout_id = run.rollout_ids().start
    while rollout_id in run.rollout_ids():
        sync_iteration(run, steps, rollout_id)
        yield rollout_id
        rollout_id += 1
        if not at_boundary(run, steps, rollout_id):
            return
    if run.should_evaluate(rollout_id):
        steps.evaluate(run, rollout_id)


def at_boundary(run: RLRun, steps: Steps, next_rollout_id: int) -> bool:
    """Between two iterations, with nothing in flight: do what the user asked. The run's checkpoint is saved first,
    where a released or cancelled run starts again. False: the run stops here (cancelled)."""
    request = steps.control.requested()
    if request is None:
        return True
    if not run.should_save(next_rollout_id - 1):
        steps.save_checkpoint(run, next_rollout_id - 1)
    if request == "cancel":
        return False
    steps.control.pause(run, next_rollout_id)
    return True


def one_step_off_policy(run: RLRun, steps: Steps) -> Iterator[int]:
    """rl-async: rollout i+1 is generated while the trainer trains on rollout i; a sync waits for the generation and
    the evaluation in flight, so the engines never change weights in the middle of either."""
    return _generating_ahead(run, steps, window=1, pushes_wait_for_generations=True)


def fully_async(run: RLRun, steps: Steps) -> Iterator[int]:
    """rl-fully-async: up to rollout.max_rollouts_in_flight generations run ahead of training, and weight pushes land
    in the middle of them (only an evaluation is waited for, so that it sees one version of the weights)."""
    window = run.config.rollout.max_rollouts_in_flight
    return _generating_ahead(run, steps, window, pushes_wait_for_generations=False)


def _generating_ahead(run: RLRun, steps: Steps, window: int, pushes_wait_for_generations: bool) -> Iterator[int]:
    """The two off-policy graphs: `window` generations in flight ahead of the rollout being trained; a push waits
    for the evaluation in flight, and for the generations too when `pushes_wait_for_generations`. Once the user asks
    for a pause or a cancel, no generation starts: the rollouts in flight are trained first (drained), then the
    boundary is reached."""
    rollout_id = run.rollout_ids().start
    evaluation = steps.evaluate.submit(run, rollout_id) if run.should_evaluate(rollout_id) else None
    in_flight: dict[int, Any] = {}

    def fill(first: int) -> None:
        for i in range(first, first + window):
            if i in run.rollout_ids() and i not in in_flight:
                in_flight[i] = steps.generate.submit(run, i)

    fill(rollout_id)
    while rollout_id in run.rollout_ids():
        table = handed_over(run, steps, rollout_id, [in_flight.pop(rollout_id)])
        if steps.control.requested() is None:
            fill(rollout_id + 1)
        train(run, steps, rollout_id, table)
        if run.should_sync(rollout_id):
            generations = list(in_flight.values()) if pushes_wait_for_generations else []
            steps.sync_weights(run, rollout_id, wait_for=[*generations, *([evaluation] if evaluation else [])])
        if run.should_evaluate(rollout_id + 1):
            evaluation = steps.evaluate.submit(run, rollout_id + 1, wait_for=[evaluation] if evaluation else None)
        if run.should_save(rollout_id):
            steps.save_checkpoint(run, rollout_id)
        yield rollout_id
        rollout_id += 1
        if steps.control.requested() is not None and not in_flight:
            if evaluation is not None:
                evaluation.result()
            if not at_boundary(run, steps, rollout_id):
                return
            fill(rollout_id)
    if evaluation is not None:
        evaluation.result()


def adapter_iteration(adapter: AdapterRun, steps: Steps, rollout_id: int) -> list:
    """One rollout of one adapter as a chain of futures; returns them in the order submitted, the chain's end last.
    The adapter changes on the engines, and the chain ends, only after its evaluation; after its last rollout it
    retires."""
    evaluation = steps.evaluate.submit(adapter, rollout_id) if adapter.should_evaluate(rollout_id) else None
    evaluated = [evaluation] if evaluation is not None else []
    chain = [*evaluated, steps.generate.submit(adapter, rollout_id)]
    chain.append(steps.get.submit(adapter, rollout_id, wait_for=[chain[-1]]))
    chain.append(steps.train_step.submit(adapter, rollout_id, chain[-1]))
    if adapter.should_push(rollout_id):
        chain.append(steps.push_adapter.submit(adapter, rollout_id, wait_for=[chain[-1], *evaluated]))
    if adapter.should_save(rollout_id):
        chain.append(steps.save_checkpoint.submit(adapter, rollout_id, wait_for=[chain[-1], *evaluated]))
    if adapter.is_last(rollout_id):
        if adapter.should_evaluate(rollout_id + 1):
            chain.append(steps.evaluate.submit(adapter, rollout_id + 1, wait_for=[chain[-1]]))
        chain.append(steps.retire_adapter.submit(adapter, wait_for=[chain[-1], *evaluated]))
    return chain


def multi_lora(run: MultiLoRARun, steps: Steps) -> Iterator[tuple[AdapterRun, int]]:
    """rl-multi-lora: each adapter's rollouts in order, the adapters side by side: an adapter's next rollout is
    submitted when its previous one ends. At each boundary (and every TENANT_POLL_S meanwhile) the run admits the
    tenants submitted since, which start at once; a withdrawn adapter is saved and retired instead of going on; an
    adapter whose chain failed is recorded (`run.failures`) and retired, and the others go on. A trainer group left
    without an adapter to train is stopped. With nothing left in flight the run waits for tenants as
    tenants.idle_timeout_s says, then ends. Once the user asks to pause or cancel, no rollout is submitted: each
    adapter waits at its boundary, and when none is in flight the run does what was asked (`at_adapters_boundary`).
    Yields (adapter, rollout_id) as each rollout ends."""
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
