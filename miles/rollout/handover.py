"""The hand-over of a stored rollout to the trainer (`RolloutExecutor.get`) as a pipeline of small pure steps, each
taking the samples the one before left: the failed samples out, the stale groups out, with dynamic sampling the
groups whose scores are all equal out, the fewest whole groups that keep the trainer's workers from equal shares out,
then the advantages of what is left (so that an estimator normalising over the batch normalises over what is
trained)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from miles.rollout.schema import ROLLOUT_SCHEMA
from miles.train.algorithms.dapo import equal_score_groups, overlong_penalty
from miles.train.algorithms.estimators import AdvantageEstimator, ScoredSamples


@dataclass(frozen=True)
class Handover:
    """The samples still on their way to the trainer, row for row: the rollout's rows, and each sample's staleness
    (weight versions behind the trainer's), score and group."""

    table: pa.Table
    staleness: np.ndarray
    scores: torch.Tensor
    groups: np.ndarray

    @classmethod
    def of(cls, table: pa.Table, trainer_version: int, scores: torch.Tensor) -> Handover:
        groups = table.column("group_index").to_numpy().copy()  # writable: torch shares it
        return cls(table, trainer_version - table.column("weight_version").to_numpy(), scores, groups)

    def keep(self, rows: np.ndarray) -> Handover:
        """Only the samples where `rows` is true."""
        return Handover(
            self.table.filter(pa.array(rows)),
            self.staleness[rows],
            self.scores[torch.from_numpy(rows)],
            self.groups[rows],
        )

    def equal_score_rows(self) -> np.ndarray:
        """The samples whose group's scores are all equal (no signal under a group baseline)."""
        return equal_score_groups(self.scores, torch.from_numpy(self.groups)).numpy()

    def group_count(self, rows: np.ndarray | None = None) -> int:
        return len(np.unique(self.groups if rows is None else self.groups[rows]))


def without_failed(table: pa.Table) -> tuple[pa.Table, int]:
    """The table without its failed samples, and how many there were."""
    failed = pc.equal(table.column("status").cast(pa.string()), "failed")
    count = pc.sum(failed).as_py() or 0
    if count:  # a filter copies every column: only when there is something to leave out
        table = table.filter(pc.invert(failed))
    return table, count


def shaped_scores(
    table: pa.Table, max_new_tokens: int, overlong_buffer_len: int | None, penalty: float
) -> torch.Tensor:
    """Each sample's score: its reward, less DAPO's overlong penalty when `overlong_buffer_len` is set (float64); the
    table holds no failed sample."""
    scores = torch.from_numpy(table.column("raw_reward").to_numpy().astype(np.float64))
    if overlong_buffer_len is None:
        return scores
    lengths = torch.from_numpy(table.column("response_length").to_numpy().copy())
    return scores + overlong_penalty(lengths, max_new_tokens, overlong_buffer_len, penalty)


def without_stale_groups(handover: Handover, bound: int | None) -> tuple[Handover, int]:
    """Without the groups of which any sample is more than `bound` weight versions behind, and how many went."""
    if bound is None:
        return handover, 0
    stale = np.unique(handover.groups[handover.staleness > bound])
    if not len(stale):
        return handover, 0
    return handover.keep(~np.isin(handover.groups, stale)), len(stale)


def dynamic_sampling(handover: Handover, max_groups: int, min_samples: int) -> tuple[Handover, int]:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, eq. 11): the first `max_groups` groups whose scores
    differ, topped up with equal-score groups (in order) only as far as `min_samples` (one global batch) needs; and
    how many equal-score groups went."""
    equal = handover.equal_score_rows()
    ids, first_row, sizes = np.unique(handover.groups, return_index=True, return_counts=True)
    differing = ~equal[first_row]
    kept = ids[differing][:max_groups]
    missing = min_samples - sizes[differing][: len(kept)].sum()
    if missing > 0:
        needed = int(np.searchsorted(np.cumsum(sizes[~differing]), missing)) + 1
        kept = np.concatenate([kept, ids[~differing][:needed]])
    rows = np.isin(handover.groups, kept)
    return handover.keep(rows), handover.group_count(equal & ~rows)


def split_evenly(handover: Handover, workers: int) -> tuple[Handover, int]:
    """Without the fewest whole groups that keep the samples from splitting evenly over `workers`, and how many went."""
    uneven = uneven_groups(handover.groups, workers)
    if not len(uneven):
        return handover, 0
    return handover.keep(~np.isin(handover.groups, uneven)), len(uneven)


def uneven_groups(groups: np.ndarray, workers: int) -> np.ndarray:
    """The groups to leave out so that the samples left split evenly over `workers`: the fewest samples, in whole
    groups (a subset-sum over the remainders; the later groups go first among equals)."""
    ids, sizes = np.unique(groups, return_counts=True)
    excess = int(sizes.sum()) % workers
    if not excess:
        return ids[:0]
    # best[r]: (samples, groups) of the smallest set of groups whose size is r modulo `workers`
    best: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}
    for group, size in reversed(list(zip(ids.tolist(), sizes.tolist(), strict=True))):
        for remainder, (total, chosen) in list(best.items()):
            key = (remainder + size) % workers
            if key not in best or total + size < best[key][0]:
                best[key] = (total + size, (*chosen, group))
    return np.array(sorted(best[excess][1]), dtype=groups.dtype)


def with_advantages(handover: Handover, estimator: AdvantageEstimator, values: pa.ListArray | None) -> pa.Table:
    """The rows with each sample's `advantage` from `estimator` (and the columns a per-token estimator adds)."""
    samples = ScoredSamples(handover.table, handover.scores, torch.from_numpy(handover.groups), values)
    advantages = estimator.estimate(samples)
    table = handover.table.set_column(
        handover.table.schema.get_field_index("advantage"),
        ROLLOUT_SCHEMA.field("advantage"),
        pa.array(advantages.per_sample.numpy().astype(np.float32)),
    )
    for name, column in advantages.columns.items():
        table = table.append_column(pa.field(name, column.type), column)
    return table
