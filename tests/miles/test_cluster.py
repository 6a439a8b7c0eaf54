"""RestartableActor: a proxy whose dead actor (group) is started again on the next call, once, however many callers met
the death; a group of several is killed whole when one member dies."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from miles.cluster.actors import ActorGroup, ActorLost, RestartableActor
from tests.helpers.faults import actor_pid, freeze_then_kill


class Counter:
    def __init__(self, start: int):
        self.value = start

    def add(self, amount: int) -> int:
        self.value += amount
        return self.value

    def payload(self) -> list[int]:
        return [self.value] * 3


CounterActor = ray.remote(num_cpus=0)(Counter)


@ray.remote(num_cpus=0)
class Consumer:
    def total(self, payload: list[int]) -> int:
        return sum(payload)

    def exit(self, payload: list[int]) -> None:
        os._exit(1)


@pytest.fixture
def counter(ray_session):
    starts: list[int] = []

    def start():
        handle = CounterActor.remote(100 * len(starts))  # "restored state": 0 at first, 100 after the first restart
        starts.append(len(starts))
        return ActorGroup([handle])

    actor = RestartableActor("counter", start)
    yield actor, starts
    actor.kill()


def test_a_dead_actor_fails_its_call_then_restarts_on_the_next(counter):
    actor, starts = counter
    assert actor.call(Counter.add, 1) == 1
    os.kill(actor_pid(actor.handles[0]), signal.SIGKILL)
    with pytest.raises(ActorLost, match="the counter died during add"):
        actor.call(Counter.add, 1)
    assert actor.call(Counter.add, 5) == 105  # rebuilt by start(), then the call
    assert starts == [0, 1]


def test_callers_that_meet_one_death_restart_it_once(counter):
    actor, starts = counter
    freeze_then_kill(actor.handles[0], after_s=0.5)
    outcomes: list = []
    threads = [threading.Thread(target=lambda: outcomes.append(_try(actor.call, Counter.add, 1))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(o, ActorLost) for o in outcomes) and len(outcomes) == 3
    assert [actor.call(Counter.add, 1) for _ in range(3)] == [101, 102, 103]
    assert starts == [0, 1]


def test_hand_over_names_a_dead_producer_and_passes_other_errors_through(counter):
    actor, starts = counter
    consumer = Consumer.remote()
    assert actor.hand_over(Counter.payload, to=lambda ref: ray.get(consumer.total.remote(ref))) == 0

    with pytest.raises(ray.exceptions.RayActorError) as caught:  # the consumer died, the producer is fine
        actor.hand_over(Counter.payload, to=lambda ref: ray.get(consumer.exit.remote(ref)))
    assert not isinstance(caught.value, ActorLost)

    consumer = Consumer.remote()
    freeze_then_kill(actor.handles[0], after_s=0.5)
    with pytest.raises(ActorLost, match="the counter died during payload"):
        actor.hand_over(Counter.payload, to=lambda ref: ray.get(consumer.total.remote(ref)))
    assert actor.hand_over(Counter.payload, to=lambda ref: ray.get(consumer.total.remote(ref))) == 300
    assert starts == [0, 1]


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank: int, generation: int, steps_ended: Path):
        self.rank, self.generation, self.steps_ended = rank, generation, steps_ended

    def step(self, wait_s: float) -> tuple[int, int]:
        time.sleep(wait_s if self.rank == 0 else 0)  # rank 0 as if blocked in a collective with a lost peer
        with open(self.steps_ended / f"group {self.generation} rank {self.rank}", "a") as ended:
            ended.write(f"{wait_s}\n")
        return self.rank, self.generation


def test_a_group_member_death_kills_the_group_and_the_next_call_restarts_every_member(ray_session, tmp_path):
    groups: list[ActorGroup] = []

    def start():
        groups.append(ActorGroup([Rank.remote(rank, len(groups), tmp_path) for rank in range(2)]))
        return groups[-1]

    group = RestartableActor("pair", start)
    try:
        assert group.call(Rank.step, 0) == (0, 0)  # rank 0's result
        freeze_then_kill(group.handles[1], after_s=0.5)
        with pytest.raises(ActorLost, match="the pair died during step"):
            group.call(Rank.step, 600)
        # Rank 0 never ended that step (it was killed with its group): the call did not wait for it.
        assert (tmp_path / "group 0 rank 0").read_text() == "0\n"
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(groups[0].handles[0].__ray_ready__.remote(), timeout=30)  # killed with its group
        assert group.call(Rank.step, 0) == (0, 1) and len(groups) == 2
    finally:
        group.kill()


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        return exc
