"""RewardScorer: a rollout's samples scored by the run's reward, each call bounded in time.

Per-sample rewards run concurrently, at most `data.reward_concurrency` at once: `async` ones on an event loop,
plain ones in worker threads. A batched reward (`score_batch`) is called once for the whole rollout. A call that
raises, returns no finite number or outlasts `data.reward_timeout_s` fails only its samples: they are stored as
`failed` and not trained on. A plain function that outlasts its time limit cannot be stopped; its thread is
left behind and the rollout goes on.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.concurrency import CallTimedOut, call_each_within

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
        self, prompts: list[str], responses: list[str], labels: list[str], finished: list[bool]
    ) -> tuple[list[float | None], list[Failure]]:
        """Each sample's reward, None where it failed; and the failures (miles.concurrency runs the calls). A
        per-sample reward sees the response, the label and whether it finished; a batched one the prompts too."""
        if self.batched:
            (outcome,) = call_each_within(
                self.reward.score_batch, [(prompts, responses, labels, finished)], 1, self.timeout_s, "reward"
            )
            outcomes = self._batch_outcomes(outcome, len(responses))
        else:
            calls = list(zip(responses, labels, finished, strict=True))
            outcomes = call_each_within(self.reward, calls, self.concurrency, self.timeout_s, "reward")
        rewards: list[float | None] = []
        failures: list[Failure] = []
        for index, outcome in enumerate(outcomes):
            reward = None if isinstance(outcome, Exception | _Failed) else finite_reward(outcome)
            if reward is None:
                failures.append((index, self._why(outcome)))
            rewards.append(reward)
        return rewards, failures

    def _why(self, outcome: Any) -> str:
        """Why a call's outcome is no reward: it was not done in time, raised, or returned no finite number."""
        if isinstance(outcome, CallTimedOut):
            return f"timed out after {self.timeout_s:g} s (data.reward_timeout_s)"
        if isinstance(outcome, _Failed):
            return outcome.why
        if isinstance(outcome, Exception):
            return f"raised {type(outcome).__name__}: {outcome}"
        return f"returned {clip(repr(outcome))}"

    @staticmethod
    def _batch_outcomes(outcome: Any, samples: int) -> list[Any]:
        """score_batch's outcome as one per sample: its values, or its failure for every sample."""
        if isinstance(outcome, Exception):
            return [outcome] * samples
        values = list(outcome) if isinstance(outcome, list | tuple) else None
        if values is None or len(values) != samples:
            what = f"{len(values)} values" if values is not None else clip(repr(outcome))
            return [_Failed(f"score_batch returned {what} for {samples} samples")] * samples
        return values


def finite_reward(value: Any) -> float | None:
    """`value` as a float when it is a finite real number (a usable reward), else None."""
    return float(value) if isinstance(value, numbers.Real) and math.isfinite(value) else None


def clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
