"""miles.state.atomic: files and JSON written whole or not at all."""

import json

import pytest

from miles.state.atomic import write_json_atomic


def test_write_json_atomic_creates_parents_and_round_trips(tmp_path):
    path = tmp_path / "a" / "b" / "state.json"
    data = {"rollout_id": 3, "metrics": {"loss": 0.5}, "ids": [1, 2]}
    write_json_atomic(path, data)
    assert json.loads(path.read_text()) == data
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]


def test_write_json_atomic_replaces(tmp_path):
    path = tmp_path / "state.json"
    write_json_atomic(path, {"v": 1})
    write_json_atomic(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_write_json_atomic_failure_keeps_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "state.json"
    write_json_atomic(path, {"v": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"v": object()})  # not JSON serialisable
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
