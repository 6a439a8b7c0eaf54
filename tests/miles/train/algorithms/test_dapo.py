"""miles.train.algorithms.dapo: the dynamic-sampling group filter and the soft overlong penalty."""

from __future__ import annotations

import pytest
import torch

from miles.train.algorithms.dapo import equal_score_groups, overlong_penalty

F64 = torch.float64


def test_equal_score_groups_on_a_mix():
    # group 4: 1, 1 -> equal; group 2: 0, 1 -> differ; group 9: 0.5, 0.5, 0.5 -> equal; group -11: one sample -> equal;
    # group 30: 0.5, 0.5000001 -> differ
    groups = torch.tensor([4, 2, 4, 2, 9, 9, -11, 9, 30, 30])
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 3.0, 0.5, 0.5, 0.5000001], dtype=F64)
    assert equal_score_groups(scores, groups).tolist() == [
        True,
        False,
        True,
        False,
        True,
        True,
        True,
        True,
        False,
        False,
    ]


def test_equal_score_groups_empty():
    out = equal_score_groups(torch.zeros(0, dtype=F64), torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0,)
    assert out.dtype == torch.bool


def test_equal_score_groups_permutation():
    groups = torch.tensor([4, 2, 4, 2, 9, 9, -11])
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 3.0], dtype=F64)
    perm = torch.tensor([6, 3, 0, 5, 1, 4, 2])
    assert equal_score_groups(scores[perm], groups[perm]).tolist() == equal_score_groups(scores, groups)[perm].tolist()


def test_overlong_penalty():
    # max_length 10, buffer 4, factor 0.5: free up to 10 - 4 = 6 tokens, then -0.5 * (length - 6) / 4:
    # 7 -> -0.125, 8 -> -0.25, 9 -> -0.375, 10 -> -0.5; beyond 10 stays -0.5
    lengths = torch.tensor([0, 3, 6, 7, 8, 9, 10, 14])
    out = overlong_penalty(lengths, max_length=10, buffer=4, factor=0.5)
    assert out.dtype == F64
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5], dtype=F64))


@pytest.mark.parametrize("length, expected", [(6, 0.0), (7, -0.125), (10, -0.5)])
def test_overlong_penalty_points(length, expected):
    out = overlong_penalty(torch.tensor([length]), max_length=10, buffer=4, factor=0.5)
    assert out.item() == pytest.approx(expected)


def test_overlong_penalty_buffer_is_whole_length():
    # buffer = max_length = 4, factor 1: every token costs 1/4: 0, 1, 2, 4 -> 0, -0.25, -0.5, -1
    out = overlong_penalty(torch.tensor([0, 1, 2, 4]), max_length=4, buffer=4, factor=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, -0.25, -0.5, -1.0], dtype=F64))
