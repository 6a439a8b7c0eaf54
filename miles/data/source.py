"""DataSource: an endless, epoch-shuffled walk over the rows, positioned by a cursor saved with the run."""

from __future__ import annotations

import numpy as np


class DataSource:
    def __init__(self, rows: list[dict[str, str]], seed: int, shuffle: bool = True):
        if not rows:
            raise ValueError("the dataset is empty")
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0  # prompts of the rollouts trained since the start of the run, across epochs
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = len(self.rows)
            self._orders = {
                epoch: np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            }
        return self._orders[epoch]

    def rows_at(self, position: int, count: int) -> list[dict[str, str]]:
        """The `count` rows of the walk from `position` on (the cursor does not move)."""
        return [self.rows[index] for index in self.indices_at(position, count)]

    def indices_at(self, position: int, count: int) -> list[int]:
        """The indices (in `rows`) of the `count` rows of the walk from `position` on."""
        n = len(self.rows)
        return [int(self._order(pos // n)[pos % n]) for pos in range(position, position + count)]

    def state_dict(self) -> dict[str, int]:
        epoch, offset = divmod(self.position, len(self.rows))
        return {"position": self.position, "epoch": epoch, "offset": offset, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"data cursor was saved with seed {state['seed']}, the run uses seed {self.seed}")
        self.position = int(state["position"])
