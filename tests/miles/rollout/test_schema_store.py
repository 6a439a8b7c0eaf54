"""miles.rollout.schema and miles.rollout.store: the rollout table on disk."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from miles.rollout.schema import (
    ROLLOUT_SCHEMA,
    SCHEMA_VERSION,
    check_schema,
    rollout_metadata,
    with_rollout_metadata,
)
from miles.rollout.store import RolloutStore
from miles.state import atomic as atomic_module
from miles.state.run_dir import RunDir
from tests.helpers.samples import rollout_table


def test_metadata_helpers():
    table = with_rollout_metadata(rollout_table(), rollout_id=5, engine="torch")
    meta = rollout_metadata(table)
    assert meta["schema_version"] == SCHEMA_VERSION
    assert meta["rollout_id"] == "5"
    assert meta["engine"] == "torch"


def test_round_trip(tmp_path):
    store = RolloutStore(RunDir(tmp_path).rollouts)
    table = with_rollout_metadata(rollout_table(), rollout_id=5, weight_version=7)
    assert not store.exists(5)
    path = store.write(5, table)
    assert path == tmp_path / "rollouts" / "rollout_5.arrow"
    assert store.path(5) == path and path.is_file()
    assert store.exists(5) and not store.exists(6)
    read = store.read(5)
    assert read.equals(table)
    assert read.schema.equals(table.schema, check_metadata=True)
    assert read.to_pylist() == table.to_pylist()
    meta = rollout_metadata(read)
    assert meta == {"schema_version": SCHEMA_VERSION, "rollout_id": "5", "weight_version": "7"}


@pytest.mark.parametrize(
    "version, dropped",
    [
        ("2", ["prompt", "num_turns", "end_reason", "weight_versions", "token_rewards", "baseline_reward"]),
        ("3", ["num_turns", "end_reason", "weight_versions", "token_rewards", "baseline_reward"]),
        ("4", ["weight_versions", "token_rewards", "baseline_reward"]),
        ("5", ["token_rewards", "baseline_reward"]),
    ],
)
def test_a_rollout_of_an_earlier_schema_reads_with_its_missing_columns_filled(tmp_path, version, dropped):
    """Version 2 had no prompt text, 2 and 3 no turn count or end reason, 2 to 4 no per-token weight versions, 2 to 5
    no per-token rewards: a run directory from then resumes, each sample one turn, its prompt text and end reason
    unknown (null), each token of its sample's weight version, its reward at its end (null token_rewards)."""
    store = RolloutStore(RunDir(tmp_path).rollouts)
    table = with_rollout_metadata(rollout_table(), rollout_id=5)
    old = table.drop_columns(dropped).replace_schema_metadata(
        {**table.schema.metadata, b"schema_version": version.encode()}
    )
    with pa.OSFile(str(store.path(5)), "wb") as sink, pa.ipc.new_file(sink, old.schema) as writer:
        writer.write_table(old)
    read = store.read(5)
    assert rollout_metadata(read)["schema_version"] == SCHEMA_VERSION == "6"
    assert read.column("token_rewards").to_pylist() == read.column("baseline_reward").to_pylist() == [None] * 3
    lengths = read.column("response_length").to_pylist()
    assert read.column("weight_versions").to_pylist() == [[5] * n for n in lengths]
    if "num_turns" in dropped:
        assert read.column("num_turns").to_pylist() == [1] * 3
        assert read.column("end_reason").to_pylist() == [None] * 3
    if "prompt" in dropped:
        assert read.column("prompt").to_pylist() == [None] * 3
    assert read.drop_columns(dropped).to_pylist() == old.to_pylist()


def test_overwrite_replaces(tmp_path):
    store = RolloutStore(RunDir(tmp_path).rollouts)
    store.write(1, rollout_table(3))
    store.write(1, rollout_table(4))
    assert store.read(1).num_rows == 4


def test_missing_column_rejected_with_its_name(tmp_path):
    store = RolloutStore(RunDir(tmp_path).rollouts)
    table = rollout_table().drop_columns(["advantage"])
    with pytest.raises(ValueError, match="advantage") as info:
        store.write(2, table)
    assert "rollout 2" in str(info.value)
    assert list(store.root.iterdir()) == []


def test_wrong_type_rejected():
    table = rollout_table()
    index = table.schema.get_field_index("raw_reward")
    bad = table.set_column(index, pa.field("raw_reward", pa.float64()), table.column("raw_reward").cast(pa.float64()))
    with pytest.raises(ValueError, match="not a rollout table"):
        check_schema(bad, "somewhere")


def test_a_null_reward_round_trips(tmp_path):
    store = RolloutStore(RunDir(tmp_path).rollouts)
    table = rollout_table()
    index = table.schema.get_field_index("raw_reward")
    store.write(
        1, table.set_column(index, ROLLOUT_SCHEMA.field("raw_reward"), pa.array([0.0, None, 1.0], pa.float32()))
    )
    assert store.read(1).column("raw_reward").to_pylist() == [0.0, None, 1.0]


def test_read_checks_schema(tmp_path):
    store = RolloutStore(RunDir(tmp_path).rollouts)
    table = rollout_table().drop_columns(["label"])
    with pa.OSFile(str(store.path(9)), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(ValueError, match="label") as info:
        store.read(9)
    assert str(store.path(9)) in str(info.value)


def test_write_leaves_no_temp_files(tmp_path):
    store = RolloutStore(RunDir(tmp_path).rollouts)
    store.write(0, rollout_table())
    store.write(1, rollout_table())
    assert sorted(p.name for p in store.root.iterdir()) == ["rollout_0.arrow", "rollout_1.arrow"]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    store = RolloutStore(RunDir(tmp_path).rollouts)

    def broken_replace(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(atomic_module.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk gone"):
        store.write(3, rollout_table())
    assert not store.exists(3)
    assert list(store.root.iterdir()) == []


def test_failed_rewrite_keeps_the_old_file(tmp_path, monkeypatch):
    store = RolloutStore(RunDir(tmp_path).rollouts)
    store.write(3, rollout_table(3))

    def broken_write_table(self, table, *args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(pa.ipc.RecordBatchFileWriter, "write_table", broken_write_table)
    with pytest.raises(RuntimeError, match="interrupted"):
        store.write(3, rollout_table(4))
    monkeypatch.undo()
    assert [p.name for p in store.root.iterdir()] == ["rollout_3.arrow"]
    assert store.read(3).num_rows == 3


def test_whole_file_is_synced_before_rename(tmp_path, monkeypatch):
    """The bytes on disk at fsync time must be the complete IPC file (footer included),
    otherwise a crash after the rename can leave a truncated, unreadable rollout."""
    store = RolloutStore(RunDir(tmp_path).rollouts)
    synced_sizes = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced_sizes.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(atomic_module.os, "fsync", recording_fsync)
    path = store.write(4, rollout_table())
    assert synced_sizes, "write never calls fsync"
    assert synced_sizes[-1] == path.stat().st_size


def test_temp_files_of_a_killed_writer_are_cleared_and_never_read_as_rollouts(tmp_path):
    (tmp_path / "rollouts").mkdir()
    unfinished = tmp_path / "rollouts" / ".rollout_3.arrow.k2j4x"
    unfinished.write_bytes(b"ARROW1\x00\x00 cut short")
    store = RolloutStore(RunDir(tmp_path).rollouts)
    assert not unfinished.exists()
    assert not store.exists(3)
