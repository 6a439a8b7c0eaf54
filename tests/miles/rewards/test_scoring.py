"""RewardScorer: plain, async and batched rewards, failures and time limits."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from miles.rewards import exact_match
from miles.rewards.scoring import RewardScorer

RESPONSES = ["1", "2", "3", "4"]
LABELS = ["1", "0", "3", "0"]
FINISHED = [True, True, True, False]


def test_a_plain_reward_scores_each_sample():
    assert RewardScorer(exact_match, 5, 4).score(RESPONSES, LABELS, FINISHED) == ([1.0, 0.0, 1.0, 0.0], [])


class _InFlight:
    """Counts the reward calls in flight, and the most at once."""

    def __init__(self):
        self.running = self.most = 0
        self.lock = threading.Lock()

    def __enter__(self):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)

    def __exit__(self, *exc):
        with self.lock:
            self.running -= 1


def _slow_check(kind: str, in_flight: _InFlight):
    """A reward that takes 0.05 s, as a remote verifier would: plain (a thread waits) or async."""
    if kind == "async":

        async def remote_check(response: str, label: str, finished: bool) -> float:
            with in_flight:
                await asyncio.sleep(0.05)
            return exact_match(response, label, finished)

        return remote_check

    def blocking_check(response: str, label: str, finished: bool) -> float:
        with in_flight:
            time.sleep(0.05)
        return exact_match(response, label, finished)

    return blocking_check


@pytest.mark.parametrize("kind", ["plain", "async"])
def test_rewards_run_concurrently_within_the_limit(kind):
    in_flight = _InFlight()
    started = time.monotonic()
    scorer = RewardScorer(_slow_check(kind, in_flight), 5, 2)
    rewards, failures = scorer.score(RESPONSES * 4, LABELS * 4, FINISHED * 4)
    assert rewards == [1.0, 0.0, 1.0, 0.0] * 4 and not failures
    assert in_flight.most == 2  # data.reward_concurrency
    assert time.monotonic() - started < 0.05 * 16 / 2 + 0.3


class _Verifier:
    def __init__(self, answer):
        self.answer = answer
        self.calls = 0

    def score_batch(self, responses, labels, finished):
        self.calls += 1
        return self.answer(responses, labels, finished)


class _AsyncVerifier:
    async def score_batch(self, responses, labels, finished):
        await asyncio.sleep(0)
        return [float(len(r)) for r in responses]


def test_a_batched_reward_is_called_once_for_the_rollout():
    verifier = _Verifier(lambda rs, ls, fs: [exact_match(r, l, f) for r, l, f in zip(rs, ls, fs, strict=True)])
    assert RewardScorer(verifier, 5, 4).score(RESPONSES, LABELS, FINISHED) == ([1.0, 0.0, 1.0, 0.0], [])
    assert verifier.calls == 1
    assert RewardScorer(_AsyncVerifier(), 5, 4).score(["a", "bb"], ["", ""], [True, True]) == ([1.0, 2.0], [])


@pytest.mark.parametrize(
    "answer, why",
    [
        (lambda rs, ls, fs: [1.0], "score_batch returned 1 values for 4 samples"),
        (lambda rs, ls, fs: 1.0, "score_batch returned 1.0 for 4 samples"),
        (lambda rs, ls, fs: 1 / 0, "raised ZeroDivisionError: division by zero"),
    ],
)
def test_a_batched_reward_that_fails_fails_every_sample(answer, why):
    rewards, failures = RewardScorer(_Verifier(answer), 5, 4).score(RESPONSES, LABELS, FINISHED)
    assert rewards == [None] * 4 and failures == [(i, why) for i in range(4)]


def test_a_slow_reward_fails_its_samples_only_and_is_not_waited_for():
    release = threading.Event()

    def sometimes_stuck(response: str, label: str, finished: bool) -> float:
        if response == "2":
            release.wait(10)  # a plain function cannot be stopped: the scorer stops waiting
        return 1.0

    async def async_stuck(response: str, label: str, finished: bool) -> float:
        if response == "3":
            await asyncio.sleep(10)
        return 1.0

    started = time.monotonic()
    for reward, stuck in ((sometimes_stuck, 1), (async_stuck, 2)):
        rewards, failures = RewardScorer(reward, 0.3, 4).score(RESPONSES, LABELS, FINISHED)
        assert rewards == [1.0 if i != stuck else None for i in range(4)]
        assert failures == [(stuck, "timed out after 0.3 s (data.reward_timeout_s)")]
    assert time.monotonic() - started < 3
    release.set()


def test_a_stuck_call_hands_the_rest_of_the_rollout_to_a_new_worker():
    """One call in flight at a time: the stuck call's thread is left behind and a new one scores the samples after it."""
    release = threading.Event()

    def stuck_on_the_second(response: str, label: str, finished: bool) -> float:
        if response == "2":
            release.wait(10)
        return exact_match(response, label, finished)

    started = time.monotonic()
    rewards, failures = RewardScorer(stuck_on_the_second, 0.3, 1).score(RESPONSES * 2, LABELS * 2, FINISHED * 2)
    assert rewards == [1.0, None, 1.0, 0.0, 1.0, None, 1.0, 0.0]
    assert failures == [
        (1, "timed out after 0.3 s (data.reward_timeout_s)"),
        (5, "timed out after 0.3 s (data.reward_timeout_s)"),
    ]
    assert time.monotonic() - started < 2
    release.set()


def test_what_is_not_a_finite_number_fails_its_sample():
    values = iter([1, float("nan"), "1.0", True])
    rewards, failures = RewardScorer(lambda r, l, f: next(values), 5, 1).score(RESPONSES, LABELS, FINISHED)
    assert rewards == [1.0, None, None, 1.0]
    assert failures == [(1, "returned nan"), (2, "returned '1.0'")]


def test_scoring_works_inside_a_running_event_loop():
    async def caller():
        return RewardScorer(exact_match, 5, 2).score(RESPONSES, LABELS, FINISHED)

    assert asyncio.run(caller()) == ([1.0, 0.0, 1.0, 0.0], [])
