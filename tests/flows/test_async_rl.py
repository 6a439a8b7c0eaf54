"""The rl-async flow: generation of rollout i+1 overlaps training on rollout i, read back from the Prefect API."""

from flows.async_rl import async_rl
from miles.run import RLRun
from miles.state.run_dir import RunDir
from tests.helpers import RECOVERY_RUN, final_weights, relative_distance
from tests.helpers.faults import assert_same_samples, assert_whole_rollouts, fault_before, freeze_then_kill
from tests.helpers.history import stored_task_runs


def _metrics(run_dir):
    return RunDir(run_dir).metrics()


def test_generation_of_the_next_rollout_overlaps_training(ray_session, prefect_api, small_config):
    config = small_config(num_rollout=3)
    state = async_rl(config, return_state=True)
    assert state.is_completed(), state.message
    runs = stored_task_runs(state.state_details.flow_run_id)

    assert all(r.state.is_completed() for r in runs.values())
    # + the final checkpoint, the evaluations of the starting and of the final weights
    assert state.result()["task_runs"] == len(runs) == 3 * 4 + 3
    assert runs["evaluate[rollout=0]"].end_time <= runs["sync_weights[rollout=0]"].start_time
    assert runs["evaluate[rollout=3]"].start_time >= runs["sync_weights[rollout=2]"].end_time
    assert [r["weight_version"] for r in RunDir(config.run_dir).evaluations()] == [0, 3]
    for i in (0, 1):
        generate_next, train, sync = (
            runs[f"generate[rollout={i + 1}]"],
            runs[f"train_step[rollout={i}]"],
            runs[f"sync_weights[rollout={i}]"],
        )
        assert generate_next.start_time < train.end_time
        assert sync.start_time >= generate_next.end_time
    metrics = _metrics(config.run_dir)
    # Rollout i >= 1 was sampled by weights one version behind the trainer that trains on it.
    assert [m["weight_version"] for m in metrics] == [0, 0, 1]
    assert [m["staleness_mean"] for m in metrics] == [0.0, 1.0, 1.0]
    for m in metrics:
        assert 0.0 < m["tis_weight_mean"] <= config.algo.tis_clip
        assert 0.0 <= m["tis_clip_fraction"] <= 1.0 and "train_rollout_kl" in m


def test_a_staleness_bound_of_zero_drops_the_stale_rollout_and_says_so(ray_session, prefect_api, small_config):
    config = small_config("rollout.max_weight_staleness=0", num_rollout=3)
    state = async_rl(config, return_state=True)

    assert state.is_failed()
    assert "dropping 8 groups staler than rollout.max_weight_staleness=0" in state.message + str(state.data)
    assert [m["rollout_id"] for m in _metrics(config.run_dir)] == [0]
    get_1 = stored_task_runs(state.state_details.flow_run_id)["get[rollout=1]"]
    assert get_1.run_count == 1 and get_1.state.is_failed()  # bad input is not retried


def test_async_flow_recovers_from_a_killed_engine_and_a_killed_trainer(
    ray_session, prefect_api, small_config, monkeypatch, tmp_path
):
    reference = small_config(**RECOVERY_RUN, run_dir=str(tmp_path / "uninterrupted"))
    assert async_rl(reference, return_state=True).is_completed()
    config = small_config(**RECOVERY_RUN)
    # generate(2) runs while the trainer steps on rollout 1; train_step(3) runs while rollout 4 is generated.
    fault_before(
        monkeypatch, RLRun, "generate", lambda run, i: i == 2, lambda run: freeze_then_kill(run.controller.engines[0])
    )
    fault_before(
        monkeypatch, RLRun, "train", lambda run, i: i == 3, lambda run: freeze_then_kill(run.trainer.handles[0])
    )

    state = async_rl(config, return_state=True)

    assert state.is_completed(), state.message
    runs = stored_task_runs(state.state_details.flow_run_id)
    assert runs["generate[rollout=2]"].run_count == 2 and runs["train_step[rollout=3]"].run_count == 2
    assert sorted(RunDir(config.run_dir).ledger().trained) == [0, 1, 2, 3, 4]
    assert_whole_rollouts(config.run_dir, range(5), config.samples_per_rollout)
    assert [m["weight_version"] for m in _metrics(config.run_dir)] == [
        m["weight_version"] for m in _metrics(reference.run_dir)
    ]
    assert_same_samples(config.run_dir, reference.run_dir, range(5))
    # An evaluation runs beside the first generation, so batch mates differ from run to run at float rounding.
    distance = relative_distance(
        final_weights(config.run_dir, 4), final_weights(reference.run_dir, 4), final_weights(reference.run_dir, 1)
    )
    assert distance < 0.02, distance  # rollouts 2..4 are a third each of the way from checkpoint 1
