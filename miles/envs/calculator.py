"""A tool environment: arithmetic prompts the model may answer with the help of a calculator.

    prompt:        12+34+56=
    model turn:    <calc>12+34</calc>          a call: integers joined by + and -
    reply:         <result>46</result>
    model turn:    <calc>46+56</calc>
    reply:         <result>102</result>
    model turn:    102                         anything else is the final answer: reward 1 if it is the label

A call that is not an expression of integers is answered with an empty result. The episode ends at the final
answer; one cut by a limit (max_turns, the token budget) earns nothing.
"""

from __future__ import annotations

import re

from miles.envs.base import StepResult

CALL = re.compile(r"^\s*<calc>(.*)</calc>\s*$", re.DOTALL)
EXPRESSION = re.compile(r"^-?\d+(?:[+-]\d+)*$")
TOOL_TOKENS = ("<calc>", "</calc>", "<result>", "</result>")


def evaluate(expression: str) -> int | None:
    """The value of integers joined by + and - (no other syntax), or None."""
    expression = expression.replace(" ", "")
    if not EXPRESSION.match(expression):
        return None
    return sum(int(term) for term in re.findall(r"[+-]?\d+", expression))


class CalculatorEnv:
    def __init__(self, row: dict):
        self.prompt = row["prompt"]
        self.label = str(row["label"]).strip()

    def reset(self) -> str:
        return self.prompt

    def step(self, model_turn: str) -> StepResult:
        call = CALL.match(model_turn)
        if call is None:
            return StepResult(reward=1.0 if model_turn.strip() == self.label else 0.0, done=True)
        value = evaluate(call.group(1))
        return StepResult(observation=f"<result>{'' if value is None else value}</result>")


def demonstration(row: dict, use_tool: bool) -> list[tuple[str, bool]]:
    """A worked episode for the supervised warm-up, as (text, the model's) turns after the prompt: one call of the
    calculator on the whole sum, its result, then the answer; or the answer alone."""
    answer = (row["label"], True)
    if not use_tool:
        return [answer]
    expression = row["prompt"].removesuffix("=")
    return [(f"<calc>{expression}</calc>", True), (f"<result>{evaluate(expression)}</result>", False), answer]
