"""Advantage estimators as objects: each declares what it needs beyond the samples' scores, and computes the
advantages of the samples handed to the trainer.

What an estimator may need, and who provides it:
- `needs_critic`: the critic's value of each trained token (a trainer group of its own, `compute_values` before
  `get` and `train_critic` after `train_step`; the schedules and the run ask this, nothing else does).
- `needs_greedy_baseline`: a greedy response to each prompt, generated with the rollout, whose reward is stored as
  each of its samples' `baseline_reward`.
- `discount`: the (gamma, lambda) of the return a per-token reward (the KL-in-reward penalty) is credited by.

A config names a built-in (miles.registry.ALGORITHMS), a `pkg.mod:fn` with the signature of
miles.train.algorithms.advantages (one score per sample in, one advantage per sample out), or a `pkg.mod:Class`
deriving AdvantageEstimator (built from the algo section by `from_algo`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from miles.train.algorithms.advantages import remax
from miles.train.algorithms.value import gae, whiten
from miles.train.batch import RETURNS, TOKEN_ADVANTAGES, VALUES, list_grid


@dataclass(frozen=True)
class ScoredSamples:
    """The samples the trainer gets (failed, stale, filtered and unevenly split groups already left out), row for row:
    the rollout's rows, each sample's score (its reward after shaping, float64) and group, and, for an estimator
    that needs a critic, the critic's values of each response token."""

    table: pa.Table
    scores: torch.Tensor
    groups: torch.Tensor
    values: pa.ListArray | None = None


@dataclass(frozen=True)
class Advantages:
    """Each sample's advantage ([N]; a per-token estimator's: that of the sample's first trained token), and the
    columns a per-token estimator adds to the rollout (name -> one list per sample)."""

    per_sample: torch.Tensor
    columns: dict[str, pa.Array] = field(default_factory=dict)


class AdvantageEstimator:
    needs_critic = False
    needs_greedy_baseline = False
    discount = (1.0, 1.0)

    @classmethod
    def from_algo(cls, algo: Any) -> AdvantageEstimator:
        """The estimator the run's `algo` section configures."""
        return cls()

    def estimate(self, samples: ScoredSamples) -> Advantages:
        raise NotImplementedError


class ScoreEstimator(AdvantageEstimator):
    """A per-sample estimator `fn(scores, groups, lengths) -> advantages` (miles.train.algorithms.advantages), each
    sample's `lengths` its trained tokens."""

    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name

    def estimate(self, samples: ScoredSamples) -> Advantages:
        lengths = torch.from_numpy(trained_tokens(samples.table))
        advantages = self.fn(samples.scores, samples.groups, lengths)
        if advantages.shape != samples.scores.shape:
            raise ValueError(
                f"algo.advantage_estimator {self.name!r} returned shape {tuple(advantages.shape)} for "
                f"{len(samples.scores)} samples"
            )
        return Advantages(advantages)


class ReMax(AdvantageEstimator):
    """miles.train.algorithms.advantages.remax: each sample's baseline is the reward of its prompt's greedy response."""

    needs_greedy_baseline = True

    def estimate(self, samples: ScoredSamples) -> Advantages:
        column = samples.table.column("baseline_reward").to_numpy(zero_copy_only=False)
        return Advantages(remax(samples.scores, torch.from_numpy(column.astype(np.float64))))


class GAE(AdvantageEstimator):
    """PPO's advantages: GAE (miles.train.algorithms.value) over each sample's trained tokens, on the critic's values
    and the per-token rewards (a sample's `token_rewards` where it has them, the rest of its score, e.g. the overlong
    penalty, at its last trained token), whitened over the trained tokens of the samples handed over (as verl does).
    Adds the columns `token_advantages`, `values` and `returns` (the critic's targets)."""

    needs_critic = True

    def __init__(self, gamma: float, lam: float):
        self.discount = (gamma, lam)

    @classmethod
    def from_algo(cls, algo: Any) -> GAE:
        return cls(algo.gamma, algo.lam)

    def estimate(self, samples: ScoredSamples) -> Advantages:
        table, values = samples.table, samples.values
        lengths = table.column("response_length").to_numpy().astype(np.int64)
        if values is None:
            raise ValueError("GAE needs the critic's values of each response token")
        width = int(lengths.max()) if len(lengths) else 0
        mask, value_grid, rewards = (
            torch.from_numpy(list_grid(column, width))
            for column in (table.column("loss_mask"), values, table.column("token_rewards"))
        )
        columns = torch.arange(width).expand_as(mask)
        last_trained = torch.where(mask > 0, columns, -1).max(dim=1).values
        scored = last_trained >= 0
        rest = samples.scores - rewards.sum(dim=1)
        rewards[scored, last_trained[scored]] += rest[scored]
        advantages, returns = gae(rewards, value_grid, mask, *self.discount)
        advantages = whiten(advantages, mask)
        first_trained = torch.where(mask > 0, columns, width).min(dim=1).values.clamp(max=max(width - 1, 0))
        per_sample = advantages.gather(1, first_trained.unsqueeze(1)).squeeze(1) if width else advantages[:, 0]
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        within = columns < torch.from_numpy(lengths).unsqueeze(1)  # each row's response tokens, in row order

        def as_lists(grid: torch.Tensor) -> pa.ListArray:
            return pa.ListArray.from_arrays(offsets, pa.array(grid[within].numpy().astype(np.float32)))

        return Advantages(
            per_sample,
            {
                name: as_lists(grid)
                for name, grid in ((TOKEN_ADVANTAGES, advantages), (VALUES, value_grid), (RETURNS, returns))
            },
        )


def trained_tokens(table: pa.Table) -> np.ndarray:
    """Each sample's trained tokens (the ones of its loss mask), float64."""
    masks = table.column("loss_mask").combine_chunks()
    running = np.concatenate([[0.0], np.cumsum(masks.values.to_numpy(zero_copy_only=False), dtype=np.float64)])
    offsets = masks.offsets.to_numpy()
    return running[offsets[1:]] - running[offsets[:-1]]
