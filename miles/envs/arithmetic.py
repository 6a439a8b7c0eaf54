"""Integer arithmetic on operands in 0..99: the embedded default's task family. `addition` and `subtraction` have
two operands (every pair); `sums` has three (a fixed sample of SUM_ROWS triples), for the calculator environment
(miles.envs.calculator), which the model may call on it."""

from __future__ import annotations

import random
from collections.abc import Callable

OPERAND_RANGE = range(100)


def _addition(a: int, b: int) -> tuple[str, str]:
    return f"{a}+{b}=", str(a + b)


def _subtraction(a: int, b: int) -> tuple[str, str]:
    return f"{a}-{b}=", str(a - b)


TASKS: dict[str, Callable[[int, int], tuple[str, str]]] = {"addition": _addition, "subtraction": _subtraction}
SUMS = "sums"
SUM_ROWS = 20_000
TASK_NAMES = sorted([*TASKS, SUMS])


def _sum_rows() -> list[dict[str, str]]:
    draw = random.Random(0)
    triples = [tuple(draw.choice(OPERAND_RANGE) for _ in range(3)) for _ in range(SUM_ROWS)]
    return [{"prompt": "+".join(map(str, t)) + "=", "label": str(sum(t))} for t in triples]


def task_rows(name: str) -> list[dict[str, str]]:
    """Every prompt of the task, in a fixed order (the data source shuffles)."""
    if name == SUMS:
        return _sum_rows()
    if name not in TASKS:
        raise ValueError(f"data.task: unknown task {name!r}; built-in tasks are {TASK_NAMES}")
    make = TASKS[name]
    rows = []
    for a in OPERAND_RANGE:
        for b in OPERAND_RANGE:
            prompt, label = make(a, b)
            rows.append({"prompt": prompt, "label": label})
    return rows
