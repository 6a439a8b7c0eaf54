"""ResumePlan: where a policy (the full model, or one adapter) picks up, computed once from its run directory."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.rollout.store import RolloutStore
from miles.state.checkpoint import latest_checkpoint, read_state
from miles.state.run_dir import RunDir
from miles.weights.version import trained_version

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePlan:
    """The latest intact checkpoint, the rollouts trained after it (re-trained from their stored files onto it, in
    order, so the trainer holds the weights it had), and from there the first rollout to train.

    The replay stops before the first rollout whose stored file is gone or damaged, or after a gap in the ledger: the
    run trains those rollouts anew.
    """

    checkpoint: Path | None
    state: dict[str, Any] | None  # the checkpoint's state.json
    replay: tuple[int, ...]

    @classmethod
    def read(cls, run_dir: RunDir, store: RolloutStore, label: str = "") -> ResumePlan:
        checkpoint = latest_checkpoint(run_dir.checkpoints)
        state = read_state(checkpoint) if checkpoint else None
        last_saved = state["rollout_id"] if state else -1
        trained = sorted(k for k in run_dir.ledger().trained if k > last_saved)
        replay: list[int] = []
        for rollout_id in trained:
            if rollout_id != last_saved + 1 + len(replay) or not store.intact(rollout_id):
                log.warning(
                    "%srollouts %s cannot be replayed (rollout %d is not stored, or damaged); they will be trained anew",
                    label,
                    trained[len(replay) :],
                    rollout_id,
                )
                break
            replay.append(rollout_id)
        return cls(checkpoint, state, tuple(replay))

    @property
    def saved_rollout_id(self) -> int:
        """The last rollout the checkpoint holds; -1 without one."""
        return self.state["rollout_id"] if self.state else -1

    @property
    def saved_weight_version(self) -> int:
        return trained_version(self.saved_rollout_id)

    @property
    def data_state(self) -> dict[str, int] | None:
        return self.state["data"] if self.state else None

    @property
    def first_rollout_id(self) -> int:
        return self.saved_rollout_id + 1 + len(self.replay)

    @property
    def trainer_version(self) -> int:
        """The version the trainer holds once restored: the checkpoint's, moved on by the replay."""
        return trained_version(self.first_rollout_id - 1)
