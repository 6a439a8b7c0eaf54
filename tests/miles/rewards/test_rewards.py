"""miles.rewards: the built-in reward functions and resolve_reward."""

from __future__ import annotations

import pytest

from miles.config import load_config
from miles.rewards import REWARDS, digit_match, exact_match, resolve_reward

CONFIG = load_config(None)

NOT_CALLABLE = 3


def constant_reward(response: str, label: str, finished: bool) -> float:
    return 0.25


def test_exact_match_needs_finished():
    assert exact_match("42", "42", True) == 1.0
    assert exact_match("42", "42", False) == 0.0


def test_exact_match_strips_and_compares():
    assert exact_match(" 42\n", "42", True) == 1.0
    assert exact_match("42", " 42 ", True) == 1.0
    assert exact_match("43", "42", True) == 0.0
    assert exact_match("420", "42", True) == 0.0
    assert exact_match("", "42", True) == 0.0


def test_digit_match_partial_credit():
    # Right-aligned: "123" vs "124": 3 vs 4 differ, 2 and 1 agree -> 2 of 3.
    assert digit_match("123", "124", True) == pytest.approx(2 / 3)
    # "23" vs "123": 3=3, 2=2, width is 3 -> 2/3.
    assert digit_match("23", "123", True) == pytest.approx(2 / 3)
    # "1123" vs "123": 3, 2, 1 agree, width 4 -> 3/4.
    assert digit_match("1123", "123", True) == pytest.approx(3 / 4)
    # "99" vs "10": nothing agrees.
    assert digit_match("99", "10", True) == 0.0
    assert digit_match("57", "57", True) == 1.0
    assert digit_match(" 57 ", "57", True) == 1.0


def test_digit_match_zero_without_eos_or_response():
    assert digit_match("57", "57", False) == 0.0
    assert digit_match("", "57", True) == 0.0
    assert digit_match("   ", "57", True) == 0.0


def test_resolve_by_name():
    assert resolve_reward("exact_match", CONFIG) is exact_match
    assert resolve_reward("digit_match", CONFIG) is digit_match
    assert set(REWARDS) >= {"exact_match", "digit_match"}


def test_resolve_by_import_path():
    fn = resolve_reward(f"{__name__}:constant_reward", CONFIG)
    assert fn is constant_reward
    assert fn("1", "2", True) == 0.25


def test_resolve_stdlib_import_path():
    import os.path

    assert resolve_reward("os.path:join", CONFIG) is os.path.join


def test_unknown_name_mentions_field():
    with pytest.raises(ValueError, match="data.reward") as info:
        resolve_reward("no_such_reward", CONFIG)
    assert "no_such_reward" in str(info.value)


@pytest.mark.parametrize("name", ["miles_no_such_module_xyz:fn", f"{__name__}:no_such_function"])
def test_unimportable_path_mentions_field(name):
    with pytest.raises(ValueError, match="data.reward"):
        resolve_reward(name, CONFIG)


def test_not_callable_mentions_field():
    with pytest.raises(ValueError, match="data.reward.*not callable"):
        resolve_reward(f"{__name__}:NOT_CALLABLE", CONFIG)
