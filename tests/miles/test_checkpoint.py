"""miles.state.checkpoint: optimizer state through torch.distributed.checkpoint as safetensors + JSON, checkpoint dirs with
checksums. (Saving with N ranks and loading with M is tested in tests/miles/train/test_trainer_group.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from miles.state import checkpoint as ckpt
from miles.state.checkpoint import (
    checkpoint_problem,
    latest_checkpoint,
    load_optimizer,
    read_state,
    save_optimizer,
)
from miles.state.run_dir import RunDir
from tests.helpers import write_checkpoint

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
    save_optimizer(model, optimizer, tmp_path)

    # A second model with the same weights but a fresh optimizer, restored from the files.
    model2, optimizer2 = _model_and_optimizer(seed=123)
    model2.load_state_dict(model.state_dict())
    load_optimizer(model2, optimizer2, tmp_path)

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
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
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
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters(), strict=True))


def test_optimizer_files_hold_no_pickle(tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    save_optimizer(model, optimizer, tmp_path)
    meta = json.loads((tmp_path / ckpt.OPTIMIZER_DIR / ckpt.OPTIMIZER_META).read_text())
    assert meta["param_groups"][0]["lr"] == pytest.approx(1e-2)
    assert meta["param_groups"][0]["betas"] == [0.9, 0.98]
    files = sorted(p.name for p in (tmp_path / ckpt.OPTIMIZER_DIR).iterdir())
    assert len(files) == 2 and files[0] == ckpt.OPTIMIZER_META and files[1].endswith(".safetensors")
    assert not (tmp_path / ckpt.OPTIMIZER_DIR / ".metadata").exists()  # DCP's own metadata file is a pickle


# ---------------------------------------------------------------- checkpoint dirs


def _complete(run_dir, rollout_id: int, **state):
    def write_files(directory):
        (directory / "model").mkdir()
        (directory / "model" / "weights.bin").write_bytes(bytes(range(256)) * 64)

    return write_checkpoint(RunDir(run_dir).checkpoint(rollout_id), rollout_id, state, write_files)


def test_latest_checkpoint_none_without_dir(tmp_path):
    assert latest_checkpoint(RunDir(tmp_path).checkpoints) is None


def test_latest_checkpoint_none_when_empty(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    assert latest_checkpoint(RunDir(tmp_path).checkpoints) is None


def test_latest_checkpoint_picks_highest_numeric(tmp_path):
    _complete(tmp_path, 2)
    _complete(tmp_path, 10)  # numerically highest; lexically "10" < "9"
    _complete(tmp_path, 9)
    staging = tmp_path / "checkpoints" / ".staging-99"
    staging.mkdir()
    (staging / ckpt.STATE_FILE).write_text("{}")  # not a numeric name
    latest = latest_checkpoint(RunDir(tmp_path).checkpoints)
    assert latest == RunDir(tmp_path).checkpoint(10)
    assert read_state(latest) == {"rollout_id": 10}


def test_a_checkpoint_is_hashed_once_per_process(tmp_path, monkeypatch):
    """A start reads the latest checkpoint for its plan and for the trainer's restore, and again at each trainer
    restart: its files are hashed the first time only, unless it is replaced."""
    _complete(tmp_path, 1)
    hashed: list[str] = []
    real = ckpt.file_sha256
    monkeypatch.setattr(ckpt, "file_sha256", lambda path: hashed.append(path.name) or real(path))
    for _ in range(3):
        assert latest_checkpoint(RunDir(tmp_path).checkpoints) == RunDir(tmp_path).checkpoint(1)
    assert sorted(hashed) == ["state.json", "weights.bin"]
    shutil.rmtree(RunDir(tmp_path).checkpoint(1))
    _complete(tmp_path, 1)  # another checkpoint under the same name
    hashed.clear()
    assert latest_checkpoint(RunDir(tmp_path).checkpoints) == RunDir(tmp_path).checkpoint(1)
    assert sorted(hashed) == ["state.json", "weights.bin"]


def test_checkpoint_carries_checksums_of_every_file(tmp_path):
    directory = _complete(tmp_path, 3)
    sums = json.loads((directory / ckpt.CHECKSUMS_FILE).read_text())
    assert sorted(sums) == ["model/weights.bin", ckpt.STATE_FILE]
    assert sums["model/weights.bin"]["bytes"] == 256 * 64
    assert checkpoint_problem(directory) is None


def _truncate(path):
    path.write_bytes(path.read_bytes()[:100])


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[7] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, problem",
    [
        (_truncate, "model/weights.bin has 100 bytes, 16384 were written"),
        (_flip_a_byte, "model/weights.bin does not match its sha256"),
        (lambda path: path.unlink(), "model/weights.bin is missing"),
        (lambda path: (path.parent.parent / ckpt.CHECKSUMS_FILE).unlink(), "checksums.json is missing or unreadable"),
    ],
)
def test_damaged_latest_checkpoint_is_reported_set_aside_and_the_previous_used(tmp_path, caplog, damage, problem):
    _complete(tmp_path, 1)
    damaged = _complete(tmp_path, 3)
    damage(damaged / "model" / "weights.bin")
    with caplog.at_level("WARNING", logger="miles.state.checkpoint"):
        latest = latest_checkpoint(RunDir(tmp_path).checkpoints)
    assert latest == RunDir(tmp_path).checkpoint(1)
    assert problem in caplog.text and str(damaged) in caplog.text
    aside = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("damaged-3-")]
    assert len(aside) == 1 and not damaged.exists()  # kept for inspection, no longer a candidate
    assert _complete(tmp_path, 3) == damaged and checkpoint_problem(damaged) is None  # the id can be saved again


def test_every_checkpoint_damaged_gives_none(tmp_path):
    (_complete(tmp_path, 0) / ckpt.STATE_FILE).write_text("{")
    assert latest_checkpoint(RunDir(tmp_path).checkpoints) is None


def test_a_retried_save_keeps_the_existing_checkpoint(tmp_path):
    target = _complete(tmp_path, 4, tag="first")
    assert _complete(tmp_path, 4, tag="retry") == target
    assert read_state(target) == {"rollout_id": 4, "tag": "first"}
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["4"]  # no staging dir left behind


def test_a_save_clears_what_a_dead_attempt_left_half_written(tmp_path):
    left = tmp_path / "checkpoints" / ".staging-4"
    (left / "model").mkdir(parents=True)
    (left / "model" / "weights.bin").write_bytes(b"cut")
    _complete(tmp_path, 4)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4"]
