"""RewardScorer: a rollout's samples scored by the run's reward, each call bounded in time.

Per-sample rewards run concurrently, at most `data.reward_concurrency` at once: `async` ones on an event loop,
plain ones in worker threads. A batched reward (`score_batch`) is called once for the whole rollout. A call that
raises, returns no finite number or outlasts `data.reward_timeout_s` fails only its samples: they are stored as
`failed` and not trained on. A plain function that outlasts its time limit cannot be stopped; its thread is
left behind and the rollout goes on.
"""

from __future__ import annotations

import asyncio
import math
import numbers
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from miles.concurrency import call_within, run_in_own_loop

# (index, what went wrong) of a sample whose reward failed
Failure = tuple[int, str]


@dataclass(frozen=True)
class _Failed:
    why: str


class RewardScorer:
    def __init__(self, reward: Callable | Any, timeout_s: float, concurrency: int):
        self.reward = reward
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.batched = not callable(reward) and callable(getattr(reward, "score_batch", None))

    def score(
        self, responses: list[str], labels: list[str], finished: list[bool]
    ) -> tuple[list[float | None], list[Failure]]:
        """Each sample's reward, None where it failed; and the failures (miles.concurrency runs the calls)."""
        outcomes = run_in_own_loop(
            lambda threads: self._score(threads, responses, labels, finished), self.concurrency, "reward"
        )
        rewards: list[float | None] = []
        failures: list[Failure] = []
        for index, outcome in enumerate(outcomes):
            if isinstance(outcome, _Failed):
                failures.append((index, outcome.why))
                rewards.append(None)
            else:
                rewards.append(outcome)
        return rewards, failures

    async def _score(
        self, threads: ThreadPoolExecutor, responses: list[str], labels: list[str], finished: list[bool]
    ) -> list[float | _Failed]:
        """Per sample: the reward, or why it failed."""
        if self.batched:
            outcome = await self._bounded(threads, self.reward.score_batch, responses, labels, finished)
            if isinstance(outcome, _Failed):
                return [outcome] * len(responses)
            values = list(outcome) if isinstance(outcome, list | tuple) else None
            if values is None or len(values) != len(responses):
                what = f"{len(values)} values" if values is not None else clip(repr(outcome))
                return [_Failed(f"score_batch returned {what} for {len(responses)} samples")] * len(responses)
            return [_checked(value) for value in values]
        limit = asyncio.Semaphore(self.concurrency)

        async def one(response: str, label: str, done: bool) -> float | _Failed:
            async with limit:
                outcome = await self._bounded(threads, self.reward, response, label, done)
            return outcome if isinstance(outcome, _Failed) else _checked(outcome)

        return await asyncio.gather(*(one(*args) for args in zip(responses, labels, finished, strict=True)))

    async def _bounded(self, threads: ThreadPoolExecutor, fn: Callable, *args: Any) -> Any:
        """`fn(*args)`'s result, or why it failed: it raised, or was not done within the time limit."""
        try:
            return await call_within(threads, self.timeout_s, fn, *args)
        except TimeoutError:
            return _Failed(f"timed out after {self.timeout_s:g} s (data.reward_timeout_s)")
        except Exception as exc:  # a user's reward can fail on any response; only its samples fail
            return _Failed(f"raised {type(exc).__name__}: {exc}")


def finite_reward(value: Any) -> float | None:
    """`value` as a float when it is a finite real number (a usable reward), else None."""
    return float(value) if isinstance(value, numbers.Real) and math.isfinite(value) else None


def _checked(value: Any) -> float | _Failed:
    reward = finite_reward(value)
    return _Failed(f"returned {clip(repr(value))}") if reward is None else reward


def clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
