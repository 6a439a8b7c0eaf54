"""The calculator environment: calls answered with their value, anything else the final answer."""

from __future__ import annotations

import pytest

from miles.envs.base import Environment, resolve_environment
from miles.envs.calculator import CalculatorEnv, demonstration, evaluate


@pytest.mark.parametrize(
    "expression, value",
    [("12+34", 46), ("46+56", 102), ("7", 7), ("-5+3", -2), ("10-3-4", 3), (" 1 + 2 ", 3), ("", None), ("2*3", None)],
)
def test_evaluate_reads_sums_and_differences_of_integers_only(expression, value):
    assert evaluate(expression) == value


def test_an_episode_calls_the_calculator_then_answers():
    env = resolve_environment("calculator")({"prompt": "12+34+56=", "label": "102"})
    assert isinstance(env, Environment) and isinstance(env, CalculatorEnv)
    assert env.reset() == "12+34+56="
    first = env.step("<calc>12+34</calc>")
    assert (first.observation, first.reward, first.done) == ("<result>46</result>", 0.0, False)
    assert env.step("<calc>12*34</calc>").observation == "<result></result>"  # not a sum: an empty result
    final = env.step("102")
    assert (final.reward, final.done) == (1.0, True)
    assert env.step(" 101 ").reward == 0.0


def test_the_warm_up_demonstration_calls_the_calculator_on_the_whole_sum():
    row = {"prompt": "12+34+56=", "label": "102"}
    assert demonstration(row, use_tool=False) == [("102", True)]
    assert demonstration(row, use_tool=True) == [
        ("<calc>12+34+56</calc>", True),
        ("<result>102</result>", False),  # the environment's turn: context, not trained on
        ("102", True),
    ]
