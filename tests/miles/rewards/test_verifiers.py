"""The math and gsm8k rewards on hand-written answers."""

from __future__ import annotations

import os
import signal
import time
from decimal import Decimal

import psutil
import pytest

from miles.config import load_config
from miles.rewards import resolve_reward, verifiers
from miles.rewards.scoring import RewardScorer
from miles.rewards.verifiers import final_number, gsm8k_answer, math_answer

# math-verify works on this tower far longer than these tests' bounds when comparing it with a number
POWER_TOWER = r"\boxed{9^{9^{9^{9}}}}"


@pytest.mark.parametrize(
    "response, label",
    [
        (r"so the answer is \boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{0.5}", "1/2"),
        (r"\boxed{1/2}", r"\frac{1}{2}"),
        (r"we get \boxed{\dfrac{1}{2}}.", r"\frac12"),
        ("The answer is 42.", "42"),
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
        (r"\boxed{x^2+2x+1}", "(x+1)^2"),
        (r"\boxed{\{1,2\}}", r"\{2,1\}"),
        (r"\boxed{1,000}", "1000"),
        (r"$\frac{3}{4}$", "0.75"),
        (r"first 3, then \boxed{7}", "7"),  # the boxed answer, not the last number
        ("$x = 5$", "5"),
    ],
)
def test_math_scores_equivalent_answers_alike(response, label):
    assert math_answer(response, label, True) == 1.0


@pytest.mark.parametrize(
    "response, label",
    [
        (r"\boxed{3}", "2"),
        (r"\boxed{x+1}", "x-1"),
        (r"\boxed{\frac{1}{3}}", "0.33"),
        ("no answer here", "3"),
        (r"\boxed{(1,2)}", "[1,2]"),  # an open interval is not a closed one
    ],
)
def test_math_scores_wrong_answers_zero(response, label):
    assert math_answer(response, label, True) == 0.0


def test_math_scores_a_cut_response_zero_and_an_unparsable_label_is_an_error():
    assert math_answer(r"\boxed{2}", "2", False) == 0.0
    with pytest.raises(ValueError, match="not an expression"):
        math_answer(r"\boxed{2}", "", True)


def _cpu_seconds_used_over(seconds: float) -> float:
    """CPU time this process and its child processes use in the next `seconds`."""

    def used() -> dict[int, float]:
        me = psutil.Process()
        return {p.pid: sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)]}

    before = used()
    time.sleep(seconds)
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in used().items())


def test_a_math_check_past_its_bound_fails_and_leaves_nothing_running(monkeypatch):
    monkeypatch.setattr(verifiers, "MATH_VERIFY_TIMEOUT_S", 1)
    started = time.monotonic()
    rewards, failures = RewardScorer(math_answer, 5, 1).score(["p"], [POWER_TOWER], ["2"], [True])
    assert time.monotonic() - started < 4  # the check's bound stopped it, not the scorer's
    assert rewards == [None]
    assert failures == [
        (0, "raised TimeoutError: math-verify took over 1 s (MATH_VERIFY_TIMEOUT_S); its worker process was killed")
    ]
    assert _cpu_seconds_used_over(2.0) < 0.5  # no thread or process goes on evaluating the tower


def test_a_stuck_math_check_holds_up_neither_the_others_nor_later_ones(monkeypatch):
    monkeypatch.setattr(verifiers, "MATH_VERIFY_TIMEOUT_S", 1)
    responses = [r"\boxed{1/2}", POWER_TOWER, r"\boxed{x^2+2x+1}", r"\boxed{3}", r"\boxed{\{1,2\}}"]
    labels = ["0.5", "2", "(x+1)^2", "2", r"\{2,1\}"]
    rewards, failures = RewardScorer(math_answer, 5, 4).score([""] * 5, responses, labels, [True] * 5)
    assert rewards == [1.0, None, 1.0, 0.0, 1.0]
    assert [index for index, _ in failures] == [1] and "MATH_VERIFY_TIMEOUT_S" in failures[0][1]
    assert math_answer(r"\boxed{1/2}", "0.5", True) == 1.0


def test_math_checks_go_on_after_an_idle_worker_dies():
    assert math_answer(r"\boxed{1/2}", "0.5", True) == 1.0
    me = psutil.Process()
    worker = next(p for p in me.children() if p.cmdline() == me.cmdline())  # a forked copy of this process
    os.kill(worker.pid, signal.SIGKILL)
    time.sleep(0.5)  # pebble notices and gives up its pool
    assert math_answer(r"\boxed{1/2}", "0.5", True) == 1.0


@pytest.mark.parametrize(
    "text, number",
    [
        ("Natalia sold 48/2 = 24 clips in May.\nAltogether 48+24 = 72 clips.\n#### 72", "72"),
        ("#### 1,250", "1250"),
        ("She pays $18 for it.\n#### $18", "18"),
        ("the total is 5 apples and then 7", "7"),
        ("#### -3.5", "-3.5"),
        ("no number", None),
    ],
)
def test_gsm8k_reads_the_number_after_the_last_marks_else_the_last_number(text, number):
    assert final_number(text) == (None if number is None else Decimal(number))


def test_gsm8k_compares_final_numbers():
    label = "Weng earns 12/60 = $0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $10.\n#### 10"
    assert gsm8k_answer("She earned 10.0 dollars. #### 10.0", label, True) == 1.0
    assert gsm8k_answer("0.2 x 50 = 10", label, True) == 1.0
    assert gsm8k_answer("#### 10\nbut maybe 12", label, True) == 1.0  # the number right after the last ####
    assert gsm8k_answer("#### 12", label, True) == 0.0
    assert gsm8k_answer("#### 10", label, False) == 0.0
    with pytest.raises(ValueError, match="holds no number"):
        gsm8k_answer("#### 10", "none", True)


def test_the_verifiers_are_built_in_rewards():
    assert (
        resolve_reward("math", load_config(None)) is math_answer
        and resolve_reward("gsm8k", load_config(None)) is gsm8k_answer
    )
