"""RewardScorer: plain, async and batched rewards, failures and time limits."""

from __future__ import annotations

import asyncio
import threading

import pytest

from miles.rewards import exact_match
from miles.rewards.scoring import RewardScorer

PROMPTS = ["0+1=", "1+1=", "1+2=", "2+2="]
RESPONSES = ["1", "2", "3", "4"]
LABELS = ["1", "0", "3", "0"]
FINISHED = [True, True, True, False]


def test_a_plain_reward_scores_each_sample():
    assert RewardScorer(exact_match, 5, 4).score(PROMPTS, RESPONSES, LABELS, FINISHED) == ([1.0, 0.0, 1.0, 0.0], [])


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


def _paired_check(kind: str, in_flight: _InFlight):
    """A reward whose calls end two at a time, plain or async: each waits (at a barrier) until another call is in
    flight beside it, so a scorer that ran them one after another would fail every sample (the barrier breaks)."""
    if kind == "async":
        pair = asyncio.Barrier(2)  # bound to the scorer's event loop at the first call

        async def remote_check(response: str, label: str, finished: bool) -> float:
            with in_flight:
                async with asyncio.timeout(10):
                    await pair.wait()
            return exact_match(response, label, finished)

        return remote_check

    barrier = threading.Barrier(2)

    def blocking_check(response: str, label: str, finished: bool) -> float:
        with in_flight:
            barrier.wait(10)
        return exact_match(response, label, finished)

    return blocking_check


@pytest.mark.parametrize("kind", ["plain", "async"])
def test_rewards_run_concurrently_within_the_limit(kind):
    in_flight = _InFlight()
    scorer = RewardScorer(_paired_check(kind, in_flight), 5, 2)
    rewards, failures = scorer.score(PROMPTS * 4, RESPONSES * 4, LABELS * 4, FINISHED * 4)
    assert not failures  # every call met another in flight: the calls ran two at a time
    assert rewards == [1.0, 0.0, 1.0, 0.0] * 4
    assert in_flight.most == 2  # data.reward_concurrency


class _Verifier:
    def __init__(self, answer):
        self.answer = answer
        self.calls = 0

    def score_batch(self, prompts, responses, labels, finished):
        self.calls += 1
        return self.answer(prompts, responses, labels, finished)


class _AsyncVerifier:
    async def score_batch(self, prompts, responses, labels, finished):
        await asyncio.sleep(0)
        return [float(len(r)) for r in responses]


def test_a_batched_reward_is_called_once_for_the_rollout():
    verifier = _Verifier(lambda ps, rs, ls, fs: [exact_match(r, l, f) for r, l, f in zip(rs, ls, fs, strict=True)])
    assert RewardScorer(verifier, 5, 4).score(PROMPTS, RESPONSES, LABELS, FINISHED) == ([1.0, 0.0, 1.0, 0.0], [])
    assert verifier.calls == 1
    assert RewardScorer(_AsyncVerifier(), 5, 4).score(["p", "q"], ["a", "bb"], ["", ""], [True, True]) == (
        [1.0, 2.0],
        [],
    )


@pytest.mark.parametrize(
    "answer, why",
    [
        (lambda ps, rs, ls, fs: [1.0], "score_batch returned 1 values for 4 samples"),
        (lambda ps, rs, ls, fs: 1.0, "score_batch returned 1.0 for 4 samples"),
        (lambda ps, rs, ls, fs: 1 / 0, "raised ZeroDivisionError: division by zero"),
    ],
)
def test_a_batched_reward_that_fails_fails_every_sample(answer, why):
    rewards, failures = RewardScorer(_Verifier(answer), 5, 4).score(PROMPTS, RESPONSES, LABELS, FINISHED)
    assert rewards == [None] * 4 and failures == [(i, why) for i in range(4)]


def test_a_slow_reward_fails_its_samples_only_and_is_not_waited_for():
    release = threading.Event()
    stuck_plain = _InFlight()
    cancelled: list[str] = []

    def sometimes_stuck(response: str, label: str, finished: bool) -> float:
        if response == "2":
            with stuck_plain:
                release.wait(10)  # a plain function cannot be stopped: the scorer stops waiting
        return 1.0

    async def async_stuck(response: str, label: str, finished: bool) -> float:
        if response == "3":
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.append(response)
                raise
        return 1.0

    for reward, stuck in ((sometimes_stuck, 1), (async_stuck, 2)):
        rewards, failures = RewardScorer(reward, 0.3, 4).score(PROMPTS, RESPONSES, LABELS, FINISHED)
        assert rewards == [1.0 if i != stuck else None for i in range(4)]
        assert failures == [(stuck, "timed out after 0.3 s (data.reward_timeout_s)")]
    assert stuck_plain.running == 1  # the plain call still runs: the scorer returned without it
    assert cancelled == ["3"]  # the async call was cancelled at its limit
    release.set()


def test_a_stuck_call_hands_the_rest_of_the_rollout_to_a_new_worker():
    """One call in flight at a time: the stuck call's thread is left behind and a new one scores the samples after it."""
    release = threading.Event()
    stuck = _InFlight()
    workers: list[threading.Thread] = []  # the thread of each call, in call order

    def stuck_on_the_second(response: str, label: str, finished: bool) -> float:
        workers.append(threading.current_thread())
        if response == "2":
            with stuck:
                release.wait(10)
        return exact_match(response, label, finished)

    rewards, failures = RewardScorer(stuck_on_the_second, 0.3, 1).score(
        PROMPTS * 2, RESPONSES * 2, LABELS * 2, FINISHED * 2
    )
    assert rewards == [1.0, None, 1.0, 0.0, 1.0, None, 1.0, 0.0]
    assert failures == [
        (1, "timed out after 0.3 s (data.reward_timeout_s)"),
        (5, "timed out after 0.3 s (data.reward_timeout_s)"),
    ]
    assert stuck.running == 2  # both stuck calls still run: the scorer returned without them
    order = list(dict.fromkeys(workers))
    assert [order.index(w) for w in workers] == [0, 0, 1, 1, 1, 1, 2, 2]  # a new worker after each stuck call
    release.set()


def test_what_is_not_a_finite_number_fails_its_sample():
    values = iter([1, float("nan"), "1.0", True])
    rewards, failures = RewardScorer(lambda r, l, f: next(values), 5, 1).score(PROMPTS, RESPONSES, LABELS, FINISHED)
    assert rewards == [1.0, None, None, 1.0]
    assert failures == [(1, "returned nan"), (2, "returned '1.0'")]


def test_scoring_works_inside_a_running_event_loop():
    async def caller():
        return RewardScorer(exact_match, 5, 2).score(PROMPTS, RESPONSES, LABELS, FINISHED)

    assert asyncio.run(caller()) == ([1.0, 0.0, 1.0, 0.0], [])
