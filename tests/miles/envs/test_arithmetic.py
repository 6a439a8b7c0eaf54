"""miles.envs.arithmetic: the built-in addition task."""

from __future__ import annotations

import pytest

from miles.envs import TASKS, task_rows


def test_addition_rows():
    rows = task_rows("addition")
    assert len(rows) == 100 * 100
    expected = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(100) for b in range(100)]
    assert rows == expected


def test_addition_rows_spot_checks():
    rows = task_rows("addition")
    assert rows[0] == {"prompt": "0+0=", "label": "0"}
    assert rows[-1] == {"prompt": "99+99=", "label": "198"}
    assert rows[1 * 100 + 2] == {"prompt": "1+2=", "label": "3"}
    assert len({r["prompt"] for r in rows}) == len(rows)
    for row in rows[::997]:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert int(row["label"]) == int(a) + int(b)


def test_rows_are_fresh_lists():
    first = task_rows("addition")
    first[0]["prompt"] = "mutated"
    assert task_rows("addition")[0]["prompt"] == "0+0="


def test_unknown_task():
    with pytest.raises(ValueError, match="data.task") as info:
        task_rows("subtraction_nope")
    assert "subtraction_nope" in str(info.value)
    assert "addition" in str(info.value)
    assert "addition" in TASKS


def test_sums_rows_are_a_fixed_sample_of_three_operand_sums():
    rows = task_rows("sums")
    assert len(rows) == 20_000 and rows == task_rows("sums")
    for row in rows[::499]:
        operands = row["prompt"].removesuffix("=").split("+")
        assert len(operands) == 3 and all(0 <= int(x) <= 99 for x in operands)
        assert int(row["label"]) == sum(map(int, operands))
