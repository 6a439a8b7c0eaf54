"""Integer arithmetic on two operands in 0..99: the embedded default's task family."""

from __future__ import annotations

from collections.abc import Callable

OPERAND_RANGE = range(100)


def _addition(a: int, b: int) -> tuple[str, str]:
    return f"{a}+{b}=", str(a + b)


def _subtraction(a: int, b: int) -> tuple[str, str]:
    return f"{a}-{b}=", str(a - b)


TASKS: dict[str, Callable[[int, int], tuple[str, str]]] = {"addition": _addition, "subtraction": _subtraction}


def task_rows(name: str) -> list[dict[str, str]]:
    """Every prompt of the task, in a fixed order (the data source shuffles)."""
    if name not in TASKS:
        raise ValueError(f"data.task: unknown task {name!r}; built-in tasks are {sorted(TASKS)}")
    make = TASKS[name]
    rows = []
    for a in OPERAND_RANGE:
        for b in OPERAND_RANGE:
            prompt, label = make(a, b)
            rows.append({"prompt": prompt, "label": label})
    return rows
