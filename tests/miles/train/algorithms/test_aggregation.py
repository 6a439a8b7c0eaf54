"""miles.train.algorithms.aggregation: each loss aggregation on hand values, and micro-batches adding up."""

from __future__ import annotations

import pytest
import torch

from miles.registry import ALGORITHMS
from miles.train.algorithms import resolve_algorithm
from miles.train.algorithms.aggregation import (
    LossScale,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
    token_sum,
)

F64 = torch.float64

# Row 0 trains all three tokens (sum 1+2+3 = 6), row 1 only its first (sum 4), row 2 none (a sequence with loss 0).
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=F64)
SCALE = LossScale(tokens=4.0, sequences=3, horizon=5)


def test_token_mean():
    # (6 + 4) / 4 tokens
    assert token_mean(VALUES, MASK, SCALE).item() == pytest.approx(2.5)


def test_seq_mean_token_sum():
    # (6 + 4 + 0) / 3 sequences
    assert seq_mean_token_sum(VALUES, MASK, SCALE).item() == pytest.approx(10 / 3)


def test_seq_mean_token_mean():
    # (6/3 + 4/1 + 0) / 3 sequences = (2 + 4) / 3
    assert seq_mean_token_mean(VALUES, MASK, SCALE).item() == pytest.approx(2.0)


def test_seq_mean_token_sum_norm():
    # (6 + 4) / (3 sequences * horizon 5)
    assert seq_mean_token_sum_norm(VALUES, MASK, SCALE).item() == pytest.approx(2 / 3)


def test_denominators_come_from_the_scale_not_the_micro_batch():
    # the same micro-batch under a global batch of 8 tokens, 6 sequences, horizon 10
    scale = LossScale(tokens=8.0, sequences=6, horizon=10)
    assert token_mean(VALUES, MASK, scale).item() == pytest.approx(10 / 8)
    assert seq_mean_token_sum(VALUES, MASK, scale).item() == pytest.approx(10 / 6)
    assert seq_mean_token_mean(VALUES, MASK, scale).item() == pytest.approx(6 / 6)
    assert seq_mean_token_sum_norm(VALUES, MASK, scale).item() == pytest.approx(10 / 60)


def test_masked_out_values_do_not_count():
    poisoned = VALUES.clone()
    poisoned[MASK == 0] = 1e9
    for fn in (token_mean, seq_mean_token_sum, seq_mean_token_mean, seq_mean_token_sum_norm):
        assert fn(poisoned, MASK, SCALE).item() == pytest.approx(fn(VALUES, MASK, SCALE).item())


def test_seq_mean_token_mean_weighs_sequences_equally():
    # a 1-token sequence of mean 4 and a 4-token sequence of mean 1: per sequence (4 + 1) / 2 = 2.5;
    # per token (4 + 1+1+1+1) / 5 = 1.6
    values = torch.tensor([[4.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=F64)
    scale = LossScale(tokens=5.0, sequences=2, horizon=4)
    assert seq_mean_token_mean(values, mask, scale).item() == pytest.approx(2.5)
    assert token_mean(values, mask, scale).item() == pytest.approx(1.6)


@pytest.mark.parametrize("name", sorted(ALGORITHMS["loss_aggregation"]))
def test_micro_batches_add_up_to_the_global_batch(name):
    aggregate = resolve_algorithm("loss_aggregation", name)
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(7, 5, generator=gen, dtype=F64)
    mask = (torch.rand(7, 5, generator=gen) < 0.6).to(F64)
    mask[3] = 0  # a sample with no trained token
    mask[0] = 1
    scale = LossScale(tokens=float(mask.sum()), sequences=7, horizon=5)
    whole = aggregate(values, mask, scale)
    for splits in ([2, 1, 4], [1] * 7, [3, 4]):
        parts = sum(aggregate(v, m, scale) for v, m in zip(values.split(splits), mask.split(splits), strict=True))
        torch.testing.assert_close(parts, whole)
    assert whole.abs().item() > 0


@pytest.mark.parametrize("name", sorted(ALGORITHMS["loss_aggregation"]))
def test_gradient_flows_to_masked_values_only(name):
    aggregate = resolve_algorithm("loss_aggregation", name)
    values = VALUES.clone().requires_grad_(True)
    aggregate(values, MASK, SCALE).backward()
    assert (values.grad[MASK == 0] == 0).all()
    assert (values.grad[MASK == 1] > 0).all()


def test_token_sum():
    # 6 + 4, no denominator
    assert token_sum(VALUES, MASK, SCALE).item() == pytest.approx(10.0)
