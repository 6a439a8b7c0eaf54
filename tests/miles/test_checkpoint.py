"""miles.checkpoint: atomic JSON, optimizer state as safetensors + JSON, checkpoint dirs and the ledger."""

from __future__ import annotations

import json

import pytest
import torch

from miles import checkpoint as ckpt
from miles.checkpoint import (
    Ledger,
    checkpoint_dir,
    commit_checkpoint,
    latest_checkpoint,
    optimizer_from_files,
    optimizer_to_files,
    read_state,
    write_json_atomic,
)


# ---------------------------------------------------------------- write_json_atomic


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


# ---------------------------------------------------------------- optimizer files


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.1)
    return model, optimizer


def _step(model, optimizer, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=gen)
    y = torch.randn(5, 2, generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _normalise(value):
    """JSON has no tuples: compare param_groups with tuples as lists."""
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    return value


def test_optimizer_round_trip(tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    _step(model, optimizer, 2)
    optimizer_to_files(optimizer, tmp_path)
    assert (tmp_path / ckpt.OPTIMIZER_TENSORS).is_file()
    assert (tmp_path / ckpt.OPTIMIZER_META).is_file()

    # A second model with the same weights but a fresh optimizer, restored from the files.
    model2, optimizer2 = _model_and_optimizer(seed=123)
    model2.load_state_dict(model.state_dict())
    optimizer_from_files(optimizer2, tmp_path)

    original, restored = optimizer.state_dict(), optimizer2.state_dict()
    assert _normalise(restored["param_groups"]) == _normalise(original["param_groups"])
    assert restored["state"].keys() == original["state"].keys()
    assert len(original["state"]) == len(list(model.parameters()))
    for pid, entries in original["state"].items():
        assert restored["state"][pid].keys() == entries.keys()
        for name, value in entries.items():
            other = restored["state"][pid][name]
            if isinstance(value, torch.Tensor):
                assert other.dtype == value.dtype and other.shape == value.shape
                assert torch.equal(other, value), (pid, name)
            else:
                assert other == value

    # One more step from both gives the same parameters.
    _step(model, optimizer, 3)
    _step(model2, optimizer2, 3)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_restored_optimizer_differs_from_fresh_one(tmp_path):
    """Guard for the test above: a fresh optimizer (no restored moments) does not match."""
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    _step(model, optimizer, 2)
    model2, optimizer2 = _model_and_optimizer(seed=123)
    model2.load_state_dict(model.state_dict())
    _step(model, optimizer, 3)
    _step(model2, optimizer2, 3)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))


def test_optimizer_files_hold_no_pickle(tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    optimizer_to_files(optimizer, tmp_path)
    meta = json.loads((tmp_path / ckpt.OPTIMIZER_META).read_text())
    assert meta["param_groups"][0]["lr"] == pytest.approx(1e-2)
    assert meta["param_groups"][0]["betas"] == [0.9, 0.98]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ckpt.OPTIMIZER_META, ckpt.OPTIMIZER_TENSORS])


# ---------------------------------------------------------------- checkpoint dirs


def _complete(run_dir, rollout_id: int, **state):
    directory = checkpoint_dir(run_dir, rollout_id)
    write_json_atomic(directory / ckpt.STATE_FILE, {"rollout_id": rollout_id, **state})
    return directory


def test_latest_checkpoint_none_without_dir(tmp_path):
    assert latest_checkpoint(tmp_path) is None


def test_latest_checkpoint_none_when_empty(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    assert latest_checkpoint(tmp_path) is None


def test_latest_checkpoint_picks_highest_numeric_complete(tmp_path):
    _complete(tmp_path, 2)
    _complete(tmp_path, 10)  # numerically highest; lexically "10" < "9"
    _complete(tmp_path, 9)
    checkpoint_dir(tmp_path, 50).mkdir()  # no state.json: incomplete
    (checkpoint_dir(tmp_path, 40) / "model").mkdir(parents=True)  # incomplete too
    staging = tmp_path / "checkpoints" / ".staging-99"
    staging.mkdir()
    (staging / ckpt.STATE_FILE).write_text("{}")  # not a numeric name
    latest = latest_checkpoint(tmp_path)
    assert latest == checkpoint_dir(tmp_path, 10)
    assert read_state(latest) == {"rollout_id": 10}


def test_latest_checkpoint_ignores_state_json_directory(tmp_path):
    _complete(tmp_path, 1)
    (checkpoint_dir(tmp_path, 5) / ckpt.STATE_FILE).mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1)


def test_commit_checkpoint_moves_staging(tmp_path):
    staging = tmp_path / "checkpoints" / ".staging"
    write_json_atomic(staging / ckpt.STATE_FILE, {"rollout_id": 4})
    target = checkpoint_dir(tmp_path, 4)
    commit_checkpoint(staging, target)
    assert not staging.exists()
    assert read_state(target) == {"rollout_id": 4}
    assert latest_checkpoint(tmp_path) == target


def test_commit_checkpoint_keeps_existing_target(tmp_path):
    target = _complete(tmp_path, 4, tag="first")
    staging = tmp_path / "checkpoints" / ".staging"
    write_json_atomic(staging / ckpt.STATE_FILE, {"rollout_id": 4, "tag": "retry"})
    commit_checkpoint(staging, target)
    assert not staging.exists()
    assert read_state(target) == {"rollout_id": 4, "tag": "first"}


# ---------------------------------------------------------------- ledger


def test_ledger_record_and_reload(tmp_path):
    ledger = Ledger(tmp_path)
    assert ledger.trained == {}
    assert not ledger.path.exists()
    ledger.record(0, {"loss": 0.5})
    ledger.record(2, {"loss": 0.25, "reward": 1.0})
    ledger.record(1, {"loss": 0.75})
    assert ledger.path == tmp_path / "ledger.json"

    reloaded = Ledger(tmp_path)
    assert reloaded.trained == {0: {"loss": 0.5}, 1: {"loss": 0.75}, 2: {"loss": 0.25, "reward": 1.0}}
    assert all(isinstance(k, int) for k in reloaded.trained)
    assert list(json.loads(ledger.path.read_text())["trained"]) == ["0", "1", "2"]


def test_ledger_record_overwrites(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.record(3, {"loss": 1.0})
    ledger.record(3, {"loss": 2.0})
    assert Ledger(tmp_path).trained == {3: {"loss": 2.0}}


def test_ledger_forget_after(tmp_path):
    ledger = Ledger(tmp_path)
    for i in range(6):
        ledger.record(i, {"step": float(i)})
    assert ledger.forget_after(2) == [3, 4, 5]
    assert sorted(ledger.trained) == [0, 1, 2]
    assert sorted(Ledger(tmp_path).trained) == [0, 1, 2]
    assert ledger.forget_after(2) == []
    assert ledger.forget_after(-1) == [0, 1, 2]
    assert Ledger(tmp_path).trained == {}


def test_ledger_forget_after_sorts_numerically(tmp_path):
    ledger = Ledger(tmp_path)
    for i in (12, 3, 100, 9):
        ledger.record(i, {})
    assert ledger.forget_after(5) == [9, 12, 100]
    assert Ledger(tmp_path).trained == {3: {}}
