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

from miles.iterations import PolicyRun
from miles.multi_lora import TENANT_POLL_S, AdapterRun, MultiLoRARun
from miles.run import RLRun

log = logging.getLogger(__name__)


class Step(Protocol):
    def __call__(self, run: PolicyRun, *args: Any, wait_for: list | None = None) -> Any: ...

    def submit(self, run: PolicyRun, *args: Any, wait_for: list | None = None) -> Any: ...


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
    """rl-sync: the iterations one after another, then the evaluation of the final weights.

        for rollout_id in start .. num_rollout - 1:
            evaluate(rollout_id)                # when due (eval.*): the weights that generate this rollout
            generate(rollout_id)                # engines sample, reward scores, Arrow file in the run dir
            compute_values(rollout_id)          # with a critic (the estimator needs one): its value of each token
            table = get(rollout_id)             # pyarrow.Table with the estimator's advantages
            train_step(rollout_id, table)       # the policy's optimizer steps, recorded in the ledger
            train_critic(rollout_id, table)     # with a critic: its value-loss steps
            sync_weights(rollout_id)            # engines get weights version rollout_id + 1 (every update_weights_interval)
            save_checkpoint(rollout_id)         # every save_interval and at the end
            at the boundary: pause or cancel when asked (the checkpoint saved first)
        evaluate(num_rollout)                   # the final weights

    A run directory that already holds checkpoints resumes after the latest one."""
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
    """rl-async: one step off-policy; rollout i+1 is generated while the trainer trains on rollout i.

        evaluation = evaluate.submit(start)                           # when due (eval.*), beside the first generation
        next_rollout = generate.submit(start)
        for rollout_id in start .. num_rollout - 1:
            compute_values(rollout_id, wait_for=[next_rollout])       # with a critic: its value of each token
            table = get(rollout_id, wait_for=[next_rollout])          # rollout i is stored
            next_rollout = generate.submit(rollout_id + 1)            # samples on the weights the engines have now
            train_step(rollout_id, table)                             # meanwhile the trainer steps on rollout i
            train_critic(rollout_id, table)                           # with a critic
            sync_weights(rollout_id, wait_for=[next_rollout, evaluation])  # never change weights mid-generation/-evaluation
            evaluation = evaluate.submit(rollout_id + 1)              # when due: weights version rollout_id + 1
            save_checkpoint(rollout_id)                               # every save_interval and at the end
            when asked to pause or cancel: no generation starts; the one in flight is trained first
        wait for evaluation

    Rollout i+1 comes from weights one version behind the trainer; the loss corrects with truncated importance
    sampling (algo.use_tis) or the engine's log-probs as the old policy (algo.use_rollout_logprobs), and
    rollout.max_weight_staleness bounds how stale a group may be. The last rollout has no next one to generate. An
    evaluation shares the engines with the generation running beside it; the engines batch them together."""
    return _generating_ahead(run, steps, window=1, pushes_wait_for_generations=True)


def fully_async(run: RLRun, steps: Steps) -> Iterator[int]:
    """rl-fully-async: generation runs ahead of training by up to rollout.max_rollouts_in_flight rollouts, and weight
    pushes land in the middle of generations.

        W = rollout.max_rollouts_in_flight
        evaluation = evaluate.submit(start)                        # when due (eval.*)
        in_flight = {i: generate.submit(i) for i in start .. start + W - 1}
        for rollout_id in start .. num_rollout - 1:
            compute_values(rollout_id, wait_for=[in_flight[rollout_id]])    # with a critic
            table = get(rollout_id, wait_for=[in_flight.pop(rollout_id)])   # oldest first; groups with a token staler
                                                                   # than rollout.max_weight_staleness are dropped
            in_flight[rollout_id + W] = generate.submit(rollout_id + W)     # the window stays full
            train_step(rollout_id, table)                          # meanwhile the engines generate the next W rollouts
            train_critic(rollout_id, table)                        # with a critic
            sync_weights(rollout_id, wait_for=[evaluation])        # every update_weights_interval; the engines pause
                                                                   # the generations in flight between two decode
                                                                   # steps, load, and continue them on the new weights
            evaluation = evaluate.submit(rollout_id + 1)           # when due
            save_checkpoint(rollout_id)                            # every save_interval and at the end
            when asked to pause or cancel: no generation starts; those in flight are trained first
        wait for evaluation

    Each token records the weight version that produced it (the rollout file's weight_versions column): a sample may
    span several versions, and the loss corrects each token with the engine's log-prob of it (algo.use_tis or
    algo.use_rollout_logprobs). The engines batch every rollout in flight together, so a rollout's slow samples no
    longer hold the engine or the trainer.

    Choose it over rl-async when response lengths are long-tailed (reasoning, agents): rl-async waits for the slowest
    sample of each rollout and pushes weights only between generations, one version behind; here tokens may be up to
    about W versions behind, bounded by rollout.max_weight_staleness. Every generation draws one round of prompts, so
    algo.dynamic_sampling is refused. The run directory is the buffer: rollouts stored but not yet trained are reused
    by a resumed run, and a retried generate regenerates the same rollout id from the same prompts and seeds."""
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
