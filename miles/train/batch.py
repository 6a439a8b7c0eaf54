"""Arrow rollout table -> padded training tensors, through zero-copy views of the list columns."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import torch

# The columns `get` adds to a rollout with algo.advantage_estimator=gae, one entry per response token.
TOKEN_ADVANTAGES, VALUES, RETURNS = "token_advantages", "values", "returns"


@dataclass
class TrainBatch:
    """Right-padded sequences (prompt then response); per-token fields live at the response token's position. The
    critic's fields (`token_advantages`, `old_values`, `returns`) are there when the table has their columns
    (algo.advantage_estimator=gae)."""

    tokens: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64
    response_mask: torch.Tensor  # [B, T] bool: a trained response token sits here
    rollout_logprobs: torch.Tensor  # [B, T] float32
    advantages: torch.Tensor  # [B] float32
    token_advantages: torch.Tensor | None = None  # [B, T] float32: GAE's, whitened
    old_values: torch.Tensor | None = None  # [B, T] float32: the critic's when the advantages were estimated
    returns: torch.Tensor | None = None  # [B, T] float32: the critic's targets

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def _map(self, per_row, per_token) -> TrainBatch:
        """A batch of each field transformed: `per_row` on [B] fields, `per_token` on [B, T] ones; None stays None."""
        values = {}
        for field in fields(self):
            tensor = getattr(self, field.name)
            values[field.name] = None if tensor is None else (per_row if tensor.dim() == 1 else per_token)(tensor)
        return TrainBatch(**values)

    def rows(self, index: slice | torch.Tensor) -> TrainBatch:
        return self._map(lambda t: t[index], lambda t: t[index])

    def trimmed(self) -> TrainBatch:
        """Without the trailing columns no row reaches (right padding): a micro-batch of short samples costs what
        its own longest sample does, not what the rollout's does. Causal attention leaves every real token's
        logits as they were."""
        width = int(self.attention_mask.any(dim=0).nonzero().max()) + 1 if self.attention_mask.any() else 1
        return self._map(lambda t: t, lambda t: t[:, :width])

    def lengths(self) -> torch.Tensor:
        """Each row's length up to its last token (right padding): what a micro-batch holding it pads to."""
        return self.attention_mask.sum(dim=1)

    def by_length(self, global_batch_size: int) -> TrainBatch:
        """The rows of each global batch longest first, so that micro-batches group samples of like lengths (the
        step's gradient is a sum over its rows: their order changes nothing but the padding)."""
        lengths = self.lengths()
        order = torch.cat(
            [
                start + torch.argsort(lengths[start : start + global_batch_size], descending=True, stable=True)
                for start in range(0, len(self), global_batch_size)
            ]
        )
        return self.rows(order)


def micro_batches(lengths: torch.Tensor, max_rows: int, max_tokens: int | None) -> list[slice]:
    """Consecutive micro-batches over rows of the given `lengths` (each row's padded length; rows longest first, as
    `by_length` leaves them): at most `max_rows` rows each and, with `max_tokens`, at most `max_tokens` padded tokens
    (rows x the micro-batch's longest row; a longer row is a micro-batch of its own): a micro-batch of short samples
    takes more of them, one of long samples fewer (verl's dynamic batch size, slime's token-based micro-batches)."""
    bounds, start, longest = [], 0, 0
    for row, length in enumerate(lengths.tolist()):
        longest_with = max(longest, length)
        rows_with = row - start + 1
        if row > start and (rows_with > max_rows or (max_tokens is not None and rows_with * longest_with > max_tokens)):
            bounds.append(slice(start, row))
            start, longest_with = row, length
        longest = longest_with
    if len(lengths):
        bounds.append(slice(start, len(lengths)))
    return bounds


def split_to(bounds: list[slice], lengths: torch.Tensor, count: int) -> list[slice]:
    """`bounds` split further into `count` micro-batches (every rank of a sharded model must run as many forwards as
    the others): the costliest micro-batch of more than one row is halved until there are `count`."""
    bounds = list(bounds)
    while len(bounds) < count:
        splittable = [b for b in bounds if b.stop - b.start > 1]
        if not splittable:
            raise ValueError(f"{len(bounds)} rows cannot make {count} micro-batches")
        widest = max(splittable, key=lambda b: (b.stop - b.start) * int(lengths[b].max()))
        middle = (widest.start + widest.stop) // 2
        at = bounds.index(widest)
        bounds[at : at + 1] = [slice(widest.start, middle), slice(middle, widest.stop)]
    return bounds


def _list_view(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list column; offsets index into values directly, slices included."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return array.offsets.to_numpy(), array.values.to_numpy(zero_copy_only=False)


def _positions(rows: int, width: int, starts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The flat index into a [rows, width] array of every list element, row i's list placed from column starts[i]:
    one repeat and one add over the elements, in int32 where the array allows (half the memory of int64)."""
    dtype = np.int32 if rows * width < 2**31 else np.int64
    lengths = np.diff(offsets)
    row_base = (np.arange(rows, dtype=np.int64) * width + starts - (offsets[:-1] - offsets[0])).astype(dtype)
    return np.repeat(row_base, lengths) + np.arange(lengths.sum(), dtype=dtype)


def _placed(rows: int, width: int, at: np.ndarray, values: np.ndarray, fill, dtype) -> np.ndarray:
    out = np.full(rows * width, fill, dtype=dtype)
    out[at] = values
    return out.reshape(rows, width)


def list_grid(column: pa.ChunkedArray | pa.Array, width: int) -> np.ndarray:
    """A list column as a [rows, width] float64 grid, each row's list from column 0 and zeros after it (a null list
    is an empty one)."""
    offsets, values = _list_view(column)
    rows = len(offsets) - 1
    at = _positions(rows, width, np.zeros(rows, dtype=np.int64), offsets)
    return _placed(rows, width, at, values[offsets[0] : offsets[-1]], 0.0, np.float64)


def batch_from_table(table: pa.Table, pad_token_id: int) -> TrainBatch:
    rows = table.num_rows
    p_off, p_val = _list_view(table.column("prompt_ids"))
    r_off, r_val = _list_view(table.column("response_ids"))
    l_off, l_val = _list_view(table.column("rollout_logprobs"))
    m_off, m_val = _list_view(table.column("loss_mask"))
    response_len = np.diff(r_off)
    for name, offsets in (("rollout_logprobs", l_off), ("loss_mask", m_off)):
        if not np.array_equal(np.diff(offsets), response_len):
            raise ValueError(f"rollout table: {name} must hold one entry per response token")
    prompt_len = np.diff(p_off)
    width = int((prompt_len + response_len).max())
    prompt_at = _positions(rows, width, np.zeros(rows, dtype=np.int64), p_off)
    response_at = _positions(rows, width, prompt_len, r_off)
    tokens = _placed(rows, width, prompt_at, p_val[p_off[0] : p_off[-1]], pad_token_id, np.int64)
    tokens.reshape(-1)[response_at] = r_val[r_off[0] : r_off[-1]]
    attention = _placed(rows, width, prompt_at, 1, 0, np.int64)
    attention.reshape(-1)[response_at] = 1

    def per_token(name: str) -> torch.Tensor | None:
        if name not in table.column_names:
            return None
        offsets, values = _list_view(table.column(name))
        if not np.array_equal(np.diff(offsets), response_len):
            raise ValueError(f"rollout table: {name} must hold one entry per response token")
        return torch.from_numpy(_placed(rows, width, response_at, values[offsets[0] : offsets[-1]], 0.0, np.float32))

    return TrainBatch(
        tokens=torch.from_numpy(tokens),
        attention_mask=torch.from_numpy(attention),
        response_mask=torch.from_numpy(
            _placed(rows, width, response_at, m_val[m_off[0] : m_off[-1]] != 0, False, bool)
        ),
        rollout_logprobs=torch.from_numpy(
            _placed(rows, width, response_at, l_val[l_off[0] : l_off[-1]], 0.0, np.float32)
        ),
        advantages=torch.from_numpy(table.column("advantage").to_numpy().astype(np.float32)),
        token_advantages=per_token(TOKEN_ADVANTAGES),
        old_values=per_token(VALUES),
        returns=per_token(RETURNS),
    )
