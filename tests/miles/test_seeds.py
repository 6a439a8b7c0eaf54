"""miles.state.seeds: every derived seed is a pure function of the run seed and a name or rollout_id."""

from miles.state.seeds import adapter_init_seed, adapter_run_seed, rollout_seed


def test_rollout_seed_is_pinned_per_rollout():
    # (1 * 1_000_003 + 2) * 1_000_033: a change here would change every run's samples.
    assert rollout_seed(1, 2) == 1_000_038_000_165
    assert rollout_seed(0, 0) == 0 and rollout_seed(0, 1) != rollout_seed(0, 2)


def test_adapters_draw_from_streams_of_their_own():
    assert adapter_run_seed(0, "add") != adapter_run_seed(0, "sub")
    assert adapter_run_seed(0, "add") != adapter_run_seed(1, "add")
    assert 0 <= adapter_run_seed(123, "add") < 2**31
    assert adapter_init_seed(0, "add") == adapter_init_seed(0, "add") != adapter_init_seed(0, "sub")
