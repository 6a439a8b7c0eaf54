"""Every seed a run derives from its `seed`, in one place. Each is a pure function of the run seed and a name or
rollout_id, so a retried or resumed step draws the same numbers, and adapters never share a stream."""

from __future__ import annotations

import zlib


def rollout_seed(run_seed: int, rollout_id: int) -> int:
    """The first sample's seed of rollout `rollout_id`; sample k of the rollout uses this + k."""
    return ((run_seed * 1_000_003 + rollout_id) * 1_000_033) % (2**62)


def train_seed(run_seed: int, rollout_id: int, rank: int) -> int:
    """The torch seed a trainer worker sets before training rollout `rollout_id` (dropout draws from it): the same
    after a restart or a replay as in a run that never stopped, so no generator state is checkpointed."""
    return ((run_seed * 1_000_003 + rollout_id) * 1_000_033 + rank) * 1_000_037 % (2**62)


def adapter_run_seed(run_seed: int, adapter: str) -> int:
    """The seed of one adapter's view of the run (its data order and rollouts)."""
    return (run_seed * 1_000_003 + zlib.crc32(adapter.encode())) % 2**31


def adapter_init_seed(run_seed: int, adapter: str) -> int:
    """The torch seed that draws a new adapter's initial LoRA weights."""
    return zlib.crc32(f"{run_seed}:{adapter}".encode())


def eval_seed(run_seed: int, dataset: str, rollout_id: int) -> int:
    """The first sample's seed of the evaluation of data set `dataset` at rollout `rollout_id`; sample k uses this + k."""
    return ((run_seed * 1_000_003 + zlib.crc32(dataset.encode())) * 1_000_033 + rollout_id) * 1_000_037 % (2**62)


def turn_seed(sample_seed: int, turn: int) -> int:
    """The seed of a sample's model turn `turn` (from 0) in a multi-turn episode; turn 0 uses the sample's own."""
    return sample_seed if turn == 0 else (sample_seed * 1_000_039 + turn) % (2**62)
