"""Arrow rollout table -> padded training tensors, through zero-copy views of the list columns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch


@dataclass
class TrainBatch:
    """Right-padded sequences (prompt then response); per-token fields live at the response token's position."""

    tokens: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64
    response_mask: torch.Tensor  # [B, T] bool: a trained response token sits here
    rollout_logprobs: torch.Tensor  # [B, T] float32
    advantages: torch.Tensor  # [B] float32

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: slice) -> "TrainBatch":
        return TrainBatch(*(t[index] for t in (self.tokens, self.attention_mask, self.response_mask, self.rollout_logprobs, self.advantages)))


def _list_view(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list column; offsets index into values directly, slices included."""
    array = column.combine_chunks()
    return array.offsets.to_numpy(), array.values.to_numpy(zero_copy_only=False)


def _scatter(rows: int, width: int, starts: np.ndarray, offsets: np.ndarray, values: np.ndarray, fill, dtype) -> np.ndarray:
    """Place row i's list at columns starts[i].. of a [rows, width] array, without a Python loop over rows."""
    lengths = np.diff(offsets)
    out = np.full((rows, width), fill, dtype=dtype)
    row = np.repeat(np.arange(rows), lengths)
    within = np.arange(lengths.sum()) - np.repeat(offsets[:-1] - offsets[0], lengths)
    out[row, np.repeat(starts, lengths) + within] = values[offsets[0] : offsets[-1]]
    return out


def batch_from_table(table: pa.Table, pad_token_id: int) -> TrainBatch:
    rows = table.num_rows
    p_off, p_val = _list_view(table.column("prompt_ids"))
    r_off, r_val = _list_view(table.column("response_ids"))
    l_off, l_val = _list_view(table.column("rollout_logprobs"))
    m_off, m_val = _list_view(table.column("loss_mask"))
    prompt_len = np.diff(p_off)
    width = int((prompt_len + np.diff(r_off)).max())
    tokens = _scatter(rows, width, np.zeros(rows, dtype=np.int64), p_off, p_val, pad_token_id, np.int64)
    tokens_resp = _scatter(rows, width, prompt_len, r_off, r_val, -1, np.int64)
    filled = tokens_resp >= 0
    tokens[filled] = tokens_resp[filled]
    attention = _scatter(rows, width, np.zeros(rows, dtype=np.int64), p_off, np.ones_like(p_val), 0, np.int64) | filled
    logprobs = _scatter(rows, width, prompt_len, l_off, l_val, 0.0, np.float32)
    loss_mask = _scatter(rows, width, prompt_len, m_off, m_val, 0, np.int8).astype(bool)
    return TrainBatch(
        tokens=torch.from_numpy(tokens),
        attention_mask=torch.from_numpy(attention.astype(np.int64)),
        response_mask=torch.from_numpy(loss_mask & filled),
        rollout_logprobs=torch.from_numpy(logprobs),
        advantages=torch.from_numpy(table.column("advantage").to_numpy().astype(np.float32)),
    )
