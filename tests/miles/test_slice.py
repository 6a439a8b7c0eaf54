"""Slice: the one place that decides what is due after each rollout of a run's start, and at the ends."""

from miles.config import load_config
from miles.iterations import Slice


def _slice(first_rollout_id: int) -> Slice:
    config = load_config(None, ["iterations_per_run=4", "update_weights_interval=3"], num_rollout=10, save_interval=5)
    return Slice(config, first_rollout_id)


def test_a_slice_is_at_most_iterations_per_run_rollouts_up_to_num_rollout():
    assert [_slice(first).rollout_ids for first in (0, 4, 8)] == [range(0, 4), range(4, 8), range(8, 10)]
    assert [r for r in range(10) if _slice(8).ends_run(r)] == [9]


def test_weights_are_synced_every_interval_and_at_a_slice_end_only_for_its_closing_evaluation():
    # update_weights_interval=3: after rollouts 2, 5, 8 (versions 3, 6, 9), mid-slice
    assert [r for r in range(0, 3) if _slice(0).sync_due(r, closing_evaluation_due=False)] == [2]
    assert [r for r in range(4, 7) if _slice(4).sync_due(r, closing_evaluation_due=False)] == [5]
    # the slice's last rollout: pushed exactly when its closing evaluation reads the weights, on the interval or not
    assert _slice(0).sync_due(3, closing_evaluation_due=True) and not _slice(0).sync_due(
        3, closing_evaluation_due=False
    )
    assert not _slice(8).sync_due(9, closing_evaluation_due=False)
    assert not _slice(4).sync_due(7, closing_evaluation_due=False)


def test_a_checkpoint_is_saved_every_save_interval_and_at_every_slice_end():
    assert [r for r in range(0, 4) if _slice(0).save_due(r)] == [3]
    assert [r for r in range(4, 8) if _slice(4).save_due(r)] == [4, 7]
    assert [r for r in range(8, 10) if _slice(8).save_due(r)] == [9]
