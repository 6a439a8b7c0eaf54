"""miles.train.batch.batch_from_table: rollout table -> right-padded training tensors."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from miles.rollout.schema import ROLLOUT_SCHEMA
from miles.train.batch import RETURNS, TrainBatch, batch_from_table, micro_batches, split_to

PAD = 13

# Three samples with different prompt and response lengths (the widest is 6 tokens).
SAMPLES = [
    dict(prompt=[1, 5, 6], response=[7, 8], logprobs=[-0.1, -0.2], loss_mask=[1, 1], advantage=0.5),
    dict(
        prompt=[1, 4],
        response=[9, 10, 11, 2],
        logprobs=[-0.3, -0.4, -0.5, -0.6],
        loss_mask=[1, 0, 1, 1],
        advantage=-1.0,
    ),
    dict(prompt=[1, 3, 4, 5, 6], response=[12], logprobs=[-0.7], loss_mask=[0], advantage=2.0),
]

# Written out by hand from SAMPLES: prompt then response, right padded to width 6.
TOKENS = [[1, 5, 6, 7, 8, PAD], [1, 4, 9, 10, 11, 2], [1, 3, 4, 5, 6, 12]]
ATTENTION = [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
RESPONSE_MASK = [[0, 0, 0, 1, 1, 0], [0, 0, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0]]
LOGPROBS = [[0, 0, 0, -0.1, -0.2, 0], [0, 0, -0.3, -0.4, -0.5, -0.6], [0, 0, 0, 0, 0, -0.7]]
ADVANTAGES = [0.5, -1.0, 2.0]


def rollout_table(samples) -> pa.Table:
    n = len(samples)
    columns = {
        "rollout_id": [3] * n,
        "sample_index": list(range(n)),
        "group_index": [i // 2 for i in range(n)],
        "adapter": ["default"] * n,
        "prompt_ids": [s["prompt"] for s in samples],
        "response_ids": [s["response"] for s in samples],
        "response_length": [len(s["response"]) for s in samples],
        "rollout_logprobs": [s["logprobs"] for s in samples],
        "loss_mask": [s["loss_mask"] for s in samples],
        "raw_reward": [1.0] * n,
        "advantage": [s["advantage"] for s in samples],
        "status": ["completed"] * n,
        "weight_version": [0] * n,
        "label": ["x"] * n,
        "prompt": ["p"] * n,
        "num_turns": [1] * n,
        "end_reason": ["done"] * n,
        "weight_versions": [[0] * len(s["response"]) for s in samples],
        "token_rewards": [None] * n,
        "baseline_reward": [None] * n,
    }
    return pa.table(columns, schema=ROLLOUT_SCHEMA)


def reference(samples, pad):
    """A plain loop over rows, independent of the vectorised scatter."""
    width = max(len(s["prompt"]) + len(s["response"]) for s in samples)
    tokens, attention, mask, logprobs = [], [], [], []
    for s in samples:
        p, r = len(s["prompt"]), len(s["response"])
        fill = width - p - r
        tokens.append(s["prompt"] + s["response"] + [pad] * fill)
        attention.append([1] * (p + r) + [0] * fill)
        mask.append([False] * p + [bool(m) for m in s["loss_mask"]] + [False] * fill)
        logprobs.append([0.0] * p + list(s["logprobs"]) + [0.0] * fill)
    return tokens, attention, mask, logprobs


def check(batch: TrainBatch, tokens, attention, response_mask, logprobs, advantages):
    assert batch.tokens.dtype == torch.int64
    assert batch.attention_mask.dtype == torch.int64
    assert batch.response_mask.dtype == torch.bool
    assert batch.rollout_logprobs.dtype == torch.float32
    assert batch.advantages.dtype == torch.float32
    assert batch.tokens.tolist() == tokens
    assert batch.attention_mask.tolist() == attention
    assert batch.response_mask.tolist() == [[bool(x) for x in row] for row in response_mask]
    torch.testing.assert_close(batch.rollout_logprobs, torch.tensor(logprobs, dtype=torch.float32))
    torch.testing.assert_close(batch.advantages, torch.tensor(advantages, dtype=torch.float32))
    assert len(batch) == len(tokens)


def test_hand_written_expectation():
    batch = batch_from_table(rollout_table(SAMPLES), pad_token_id=PAD)
    check(batch, TOKENS, ATTENTION, RESPONSE_MASK, LOGPROBS, ADVANTAGES)


def test_matches_reference_loop():
    batch = batch_from_table(rollout_table(SAMPLES), pad_token_id=PAD)
    tokens, attention, mask, logprobs = reference(SAMPLES, PAD)
    check(batch, tokens, attention, mask, logprobs, ADVANTAGES)


@pytest.mark.parametrize("start,length", [(1, 2), (0, 1), (2, 1), (0, 2), (1, 1)])
def test_sliced_table(start, length):
    table = rollout_table(SAMPLES).slice(start, length)
    chosen = SAMPLES[start : start + length]
    batch = batch_from_table(table, pad_token_id=PAD)
    tokens, attention, mask, logprobs = reference(chosen, PAD)
    check(batch, tokens, attention, mask, logprobs, [s["advantage"] for s in chosen])


def test_slice_1_2_by_hand():
    batch = batch_from_table(rollout_table(SAMPLES).slice(1, 2), pad_token_id=PAD)
    check(batch, TOKENS[1:], ATTENTION[1:], RESPONSE_MASK[1:], LOGPROBS[1:], ADVANTAGES[1:])


def test_multi_chunk_table():
    whole = rollout_table(SAMPLES)
    table = pa.concat_tables([whole.slice(2, 1), whole.slice(0, 2)])
    assert table.column("prompt_ids").num_chunks == 2
    order = [SAMPLES[2], SAMPLES[0], SAMPLES[1]]
    batch = batch_from_table(table, pad_token_id=PAD)
    tokens, attention, mask, logprobs = reference(order, PAD)
    check(batch, tokens, attention, mask, logprobs, [s["advantage"] for s in order])


def test_response_token_equal_to_pad_is_attended():
    samples = [
        dict(prompt=[1, 4], response=[0, 5], logprobs=[-1.0, -2.0], loss_mask=[1, 1], advantage=1.0),
        dict(prompt=[1, 4, 4, 4], response=[6], logprobs=[-3.0], loss_mask=[1], advantage=0.0),
    ]
    batch = batch_from_table(rollout_table(samples), pad_token_id=0)
    tokens, attention, mask, logprobs = reference(samples, 0)
    assert tokens[0] == [1, 4, 0, 5, 0]
    assert attention[0] == [1, 1, 1, 1, 0]
    check(batch, tokens, attention, mask, logprobs, [1.0, 0.0])


def test_empty_response():
    samples = [
        dict(prompt=[1, 7, 8], response=[], logprobs=[], loss_mask=[], advantage=0.0),
        dict(prompt=[1, 4], response=[9, 2], logprobs=[-0.5, -0.25], loss_mask=[1, 1], advantage=1.0),
    ]
    batch = batch_from_table(rollout_table(samples), pad_token_id=PAD)
    tokens, attention, mask, logprobs = reference(samples, PAD)
    check(batch, tokens, attention, mask, logprobs, [0.0, 1.0])
    assert not batch.response_mask[0].any()


def test_rows_slices_every_field():
    batch = batch_from_table(rollout_table(SAMPLES), pad_token_id=PAD)
    part = batch.rows(slice(1, 3))
    check(part, TOKENS[1:], ATTENTION[1:], RESPONSE_MASK[1:], LOGPROBS[1:], ADVANTAGES[1:])


def test_micro_batches_cost_their_own_longest_sample():
    """Right padding: a micro-batch is trimmed to its own longest sample, and each global batch is ordered longest
    first, so that like lengths share micro-batches."""
    samples = [
        {"prompt": [1, 5], "response": [4] * n, "logprobs": [-0.5] * n, "loss_mask": [1] * n, "advantage": float(n)}
        for n in (1, 9, 2, 7)
    ]
    batch = batch_from_table(rollout_table(samples), pad_token_id=0)
    ordered = batch.by_length(global_batch_size=2)
    assert ordered.advantages.tolist() == [9.0, 1.0, 7.0, 2.0]  # within each global batch of two
    short = ordered.rows(slice(2, 4)).trimmed()
    assert short.tokens.shape == (2, 9) and batch.tokens.shape == (4, 11)
    assert torch.equal(short.tokens, ordered.tokens[2:4, :9]) and not ordered.attention_mask[2:4, 9:].any()


def test_token_budget_micro_batches_by_hand():
    lengths = torch.tensor([9, 9, 8, 5, 5, 3])
    # 2 x 9 = 18 fits 20 (a third row would make 27); 2 x 8 = 16 (3 x 8 = 24 would not); 2 x 5 = 10
    assert micro_batches(lengths, max_rows=16, max_tokens=20) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    # by count alone
    assert micro_batches(lengths, max_rows=4, max_tokens=None) == [slice(0, 4), slice(4, 6)]
    # both bounds: the row count binds first for the short rows
    assert micro_batches(lengths, max_rows=2, max_tokens=100) == [slice(0, 2), slice(2, 4), slice(4, 6)]


def test_a_row_longer_than_the_token_budget_goes_alone():
    assert micro_batches(torch.tensor([30, 4, 4]), max_rows=8, max_tokens=20) == [slice(0, 1), slice(1, 3)]


def test_micro_batches_are_split_to_the_count_the_other_ranks_need():
    lengths = torch.tensor([9, 9, 8, 5])
    # halving [0, 4) gives costs 18 and 16; the costlier half is halved next
    assert split_to([slice(0, 4)], lengths, 3) == [slice(0, 1), slice(1, 2), slice(2, 4)]
    assert split_to([slice(0, 2), slice(2, 4)], lengths, 2) == [slice(0, 2), slice(2, 4)]
    with pytest.raises(ValueError, match="2 rows cannot make 3 micro-batches"):
        split_to([slice(0, 1), slice(1, 2)], lengths[:2], 3)


def test_the_critics_per_token_columns_sit_at_their_response_tokens_and_follow_the_rows():
    returns = pa.array([[0.5, 1.5], [1.0, 2.0, 3.0, 4.0], [9.0]], pa.list_(pa.float32()))
    table = rollout_table(SAMPLES).append_column(RETURNS, returns)
    batch = batch_from_table(table, pad_token_id=PAD)
    expected = [[0, 0, 0, 0.5, 1.5, 0], [0, 0, 1, 2, 3, 4], [0, 0, 0, 0, 0, 9]]
    torch.testing.assert_close(batch.returns, torch.tensor(expected))
    assert batch.old_values is None and batch.token_advantages is None
    part = batch.rows(torch.tensor([2, 0])).trimmed()
    torch.testing.assert_close(part.returns, torch.tensor([expected[2], expected[0]]))
    short = table.drop_columns([RETURNS]).append_column(RETURNS, pa.array([[1.0], [1.0], [1.0]]))
    with pytest.raises(ValueError, match="returns must hold one entry per response token"):
        batch_from_table(short, pad_token_id=PAD)
