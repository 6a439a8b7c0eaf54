"""Environments, by import path, for the episode tests: a quiz of sums, and ones that fail in chosen ways."""

from __future__ import annotations

import asyncio
import time

from miles.envs.base import StepResult

QUESTIONS = 3


class SumQuiz:
    """Asks QUESTIONS sums in a row, the first from the data row; a right answer earns 1. The questions after the
    first are "<n>+<n>=" for n = 1, 2, ..."""

    def __init__(self, row: dict):
        self.question = row["prompt"]
        self.asked = 1

    def reset(self) -> str:
        return self.question

    def step(self, model_turn: str) -> StepResult:
        a, b = self.question.rstrip("=").split("+")
        reward = 1.0 if model_turn.strip() == str(int(a) + int(b)) else 0.0
        if self.asked == QUESTIONS:
            return StepResult(reward=reward, done=True)
        self.question = f"{self.asked}+{self.asked}="
        self.asked += 1
        return StepResult(observation=self.question, reward=reward)

    def finish(self, reason: str) -> float:
        return 0.5 if reason == "done" else -1.0  # a bonus for a quiz seen to its end, a penalty for a cut one


class AsyncSumQuiz(SumQuiz):
    async def reset(self) -> str:
        await asyncio.sleep(0)
        return self.question

    async def step(self, model_turn: str) -> StepResult:
        await asyncio.sleep(0)
        return SumQuiz.step(self, model_turn)


class BreaksOnLabel(SumQuiz):
    """Fails as its row's label says: `raise` in step, `block` (past any short time limit), `reset` in reset,
    `reward` with a reward that is not a number; any other label: a quiz."""

    def __init__(self, row: dict):
        super().__init__(row)
        self.how = row["label"]

    def reset(self) -> str:
        if self.how == "reset":
            raise ConnectionError("sandbox unreachable")
        return self.question

    def step(self, model_turn: str) -> StepResult:
        if self.how == "raise":
            raise RuntimeError("tool crashed")
        if self.how == "block":
            time.sleep(2)
        if self.how == "reward":
            return StepResult(observation="1+1=", reward=float("nan"))
        return super().step(model_turn)


class HangsOnLabel(SumQuiz):
    """An async step that never returns on rows labelled `hang`."""

    async def step(self, model_turn: str) -> StepResult:
        if self.label_of_row == "hang":
            await asyncio.sleep(3600)
        return SumQuiz.step(self, model_turn)

    def __init__(self, row: dict):
        super().__init__(row)
        self.label_of_row = row["label"]


class NeverDone:
    """Replies to every turn with the same question and never ends the episode."""

    def __init__(self, row: dict):
        self.question = row["prompt"]

    def reset(self) -> str:
        return self.question

    def step(self, model_turn: str) -> StepResult:
        return StepResult(observation=self.question, reward=0.25)
