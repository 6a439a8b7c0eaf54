"""ResumePlan: the checkpoint, the rollouts to replay onto it, and the first rollout to train."""

import pytest

from miles.resume import ResumePlan
from miles.rollout.store import RolloutStore
from miles.state.run_dir import RunDir
from tests.helpers import write_checkpoint
from tests.helpers.samples import rollout_table


def _run_dir(tmp_path, saved: int | None, trained: list[int], stored: list[int]):
    run_dir = RunDir(tmp_path)
    store = RolloutStore(run_dir.rollouts)
    if saved is not None:
        state = {"weight_version": saved + 1, "data": {"position": 8 * (saved + 1), "seed": 0}}
        write_checkpoint(
            run_dir.checkpoint(saved), saved, state, lambda staging: (staging / "weights.bin").write_bytes(b"w")
        )
    ledger = run_dir.ledger()
    for rollout_id in trained:
        ledger.record(rollout_id, {"loss": float(rollout_id)})
    for rollout_id in stored:
        store.write(rollout_id, rollout_table(rollout_id=rollout_id))
    return run_dir, store


def test_a_new_run_starts_at_rollout_zero(tmp_path):
    plan = ResumePlan.read(*_run_dir(tmp_path, saved=None, trained=[], stored=[]))
    assert (plan.checkpoint, plan.replay, plan.first_rollout_id) == (None, (), 0)
    assert plan.saved_rollout_id == -1 and plan.saved_weight_version == 0 and plan.data_state is None


def test_rollouts_trained_after_the_checkpoint_are_replayed(tmp_path):
    run_dir, store = _run_dir(tmp_path, saved=1, trained=[0, 1, 2, 3], stored=[0, 1, 2, 3])
    plan = ResumePlan.read(run_dir, store)
    assert plan.checkpoint == run_dir.checkpoint(1)
    assert plan.replay == (2, 3) and plan.first_rollout_id == 4
    assert plan.saved_weight_version == 2 and plan.data_state == {"position": 16, "seed": 0}


@pytest.mark.parametrize(
    "trained, stored, replay",
    [
        ([0, 1, 2, 3], [2], (2,)),  # rollout 3's file is gone: trained anew
        ([0, 1, 3], [3], ()),  # a gap in the ledger: nothing after it can be replayed
    ],
)
def test_the_replay_stops_where_it_cannot_go_on_and_says_so(tmp_path, caplog, trained, stored, replay):
    with caplog.at_level("WARNING", logger="miles.resume"):
        plan = ResumePlan.read(*_run_dir(tmp_path, saved=1, trained=trained, stored=stored), label="add, ")
    assert plan.replay == replay and plan.first_rollout_id == 2 + len(replay)
    assert "add, rollouts [3] cannot be replayed" in caplog.text


def test_a_damaged_rollout_file_ends_the_replay_before_it(tmp_path, caplog):
    run_dir, store = _run_dir(tmp_path, saved=1, trained=[0, 1, 2, 3], stored=[0, 1, 2, 3])
    store.path(3).write_bytes(store.path(3).read_bytes()[:-20])  # its footer torn off
    with caplog.at_level("WARNING", logger="miles.resume"):
        plan = ResumePlan.read(run_dir, store)
    assert plan.replay == (2,) and plan.first_rollout_id == 3
    assert "rollouts [3] cannot be replayed (rollout 3 is not stored, or damaged)" in caplog.text
