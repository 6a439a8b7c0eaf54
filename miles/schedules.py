"""Each single-policy flow graph's schedule, written once (the multi-LoRA run's lives with it, in
miles.multi_lora.schedule): which steps run for each rollout, in what order, and what runs beside what. A schedule
runs over `Steps`: the Prefect tasks (the flows in flows/) or the plain steps (miles.loop), so a
flow and its plain loop are one schedule, and give the same rollouts and weights.

A step is called as `step(run, *args, wait_for=[...])`, which runs it once the futures in `wait_for` are done and
returns its result, or submitted as `step.submit(run, *args, wait_for=[...])`, which returns a future (`result()`,
`add_done_callback(fn)`). Each schedule is a generator: it yields a policy's rollout_id when that iteration is done
(the single-policy graphs yield the rollout_id, the multi-LoRA graph `(adapter, rollout_id)`), and the caller
finishes the iteration (its metrics line, its row in the UI).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from miles.iterations import PolicyRun
from miles.run import RLRun

log = logging.getLogger(__name__)


class Step(Protocol):
    def __call__(self, run: PolicyRun, *args: Any, wait_for: list | None = None) -> Any: ...

    def submit(self, run: PolicyRun, *args: Any, wait_for: list | None = None) -> Any: ...


class Releasable(Protocol):
    """A run whose engines and trainer groups a pause may release, and start again at the resume."""

    def release(self) -> None: ...

    def start_again(self) -> None: ...


class Control(Protocol):
    """What a user asks of a running schedule, which it does at the next iteration boundary, with nothing in flight
    (control/requests.py: the Prefect UI, API and automations)."""

    def requested(self) -> Literal["pause", "cancel"] | None: ...

    def pause(self, run: Any, next_rollout_id: int) -> None:
        """Wait until the user resumes the run; apply what they changed meanwhile (`run.change_config`)."""

    def hold(self, run: Releasable) -> None:
        """Wait until the user resumes the multi-LoRA run, changing nothing: each adapter's settings are its own."""


class NoControl:
    """A schedule nobody pauses or cancels (the plain loops)."""

    def requested(self) -> None:
        return None

    def pause(self, run: Any, next_rollout_id: int) -> None:
        raise AssertionError("nothing requested a pause")

    def hold(self, run: Releasable) -> None:
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
