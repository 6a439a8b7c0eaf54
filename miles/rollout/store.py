"""Arrow IPC files per rollout (rollout_<id>.arrow) in one directory, written atomically, read memory-mapped; beside
each, with a critic (algo.advantage_estimator=gae), the critic's values of its tokens (values_<id>.arrow)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from miles.rollout.schema import check_schema, upgraded
from miles.state.atomic import atomic_file

VALUES_SCHEMA = pa.schema([("sample_index", pa.int64()), ("values", pa.list_(pa.float32()))])


class RolloutStore:
    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        # A process killed while writing leaves its temp file (never a partial rollout file): clear them.
        for unfinished in [*self.root.glob(".rollout_*"), *self.root.glob(".values_*")]:
            unfinished.unlink()

    def path(self, rollout_id: int) -> Path:
        return self.root / f"rollout_{rollout_id}.arrow"

    def exists(self, rollout_id: int) -> bool:
        return self.path(rollout_id).exists()

    def write(self, rollout_id: int, table: pa.Table) -> Path:
        check_schema(table, f"rollout {rollout_id}")
        target = self.path(rollout_id)
        # The Arrow footer is written when the writer closes, before atomic_file syncs and renames.
        with atomic_file(target) as sink:
            with pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
        return target

    def read(self, rollout_id: int) -> pa.Table:
        """The stored rollout; DamagedRollout, naming the file, when it cannot be read as one."""
        path = self.path(rollout_id)
        try:
            with pa.memory_map(str(path), "r") as source:
                table = upgraded(pa.ipc.open_file(source).read_all())
            check_schema(table, str(path))
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as exc:  # pa.ArrowInvalid is a ValueError
            raise DamagedRollout(f"{path} is damaged: {exc}") from None
        return table

    def values_path(self, rollout_id: int) -> Path:
        return self.root / f"values_{rollout_id}.arrow"

    def write_values(self, rollout_id: int, sample_index: list[int], values: list[list[float]]) -> None:
        """The critic's values of each sample's response tokens, as estimated before the rollout was trained on."""
        table = pa.table([pa.array(sample_index, pa.int64()), pa.array(values, pa.list_(pa.float32()))], VALUES_SCHEMA)
        with atomic_file(self.values_path(rollout_id)) as sink:
            with pa.ipc.new_file(sink, VALUES_SCHEMA) as writer:
                writer.write_table(table)

    def read_values(self, rollout_id: int) -> pa.Table | None:
        """The stored values of the rollout; None when they were never computed."""
        path = self.values_path(rollout_id)
        if not path.exists():
            return None
        with pa.memory_map(str(path), "r") as source:
            return pa.ipc.open_file(source).read_all()

    def intact(self, rollout_id: int) -> bool:
        """Whether the rollout is stored and reads as one."""
        try:
            self.read(rollout_id)
        except (FileNotFoundError, DamagedRollout):
            return False
        return True

    def set_aside(self, rollout_id: int, why: str) -> Path:
        """Move the stored rollout out of the way (into set_aside/, kept for a look), so that it is generated again."""
        aside = self.root / "set_aside"
        aside.mkdir(exist_ok=True)
        number = len(list(aside.glob(f"rollout_{rollout_id}.*")))
        target = aside / f"rollout_{rollout_id}.{why}.{number}.arrow"
        self.path(rollout_id).rename(target)
        self.values_path(rollout_id).unlink(missing_ok=True)  # the critic's values of the rollout set aside
        return target


class DamagedRollout(ValueError):
    """A stored rollout file that does not read as a rollout (a torn or altered file)."""
