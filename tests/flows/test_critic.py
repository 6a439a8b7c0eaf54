"""PPO with a critic (algo.advantage_estimator=gae) in the rl-sync and rl-async flows: compute_values and train_critic
are tasks of their own, retried; a killed critic worker takes its group down and the retry restarts it from its
checkpoint and the ledgers, so that each rollout is trained once and the weights equal an uninterrupted run's."""

from flows.async_rl import async_rl
from flows.sync_rl import sync_rl
from miles.loop import run_async, run_sync
from miles.run import RLRun
from miles.state.run_dir import RunDir
from tests.helpers import RECOVERY_RUN, final_weights, max_abs_diff
from tests.helpers.faults import assert_same_samples, fault_before, freeze_then_kill
from tests.helpers.history import retried_task_runs, stored_task_runs
from tests.miles.train.test_critic import GAE, critic_weights


def _gaps(run_dir, reference_dir) -> tuple[float, float]:
    """(policy, critic) max abs differences of the final weights."""
    return (
        max_abs_diff(final_weights(run_dir, 4), final_weights(reference_dir, 4)),
        max_abs_diff(critic_weights(run_dir, 4), critic_weights(reference_dir, 4)),
    )


def test_the_sync_flow_recovers_a_critic_of_two_workers_one_of_which_is_killed(
    ray_session, prefect_api, small_config, monkeypatch, tmp_path
):
    reference = small_config(*GAE, "critic.num_workers=2", **RECOVERY_RUN, run_dir=str(tmp_path / "uninterrupted"))
    run_sync(reference)
    config = small_config(*GAE, "critic.num_workers=2", **RECOVERY_RUN)
    # Rollout 2 is trained after the critic's checkpoint 1: the restarted critic replays it before rollout 3.
    killed = fault_before(
        monkeypatch, RLRun, "train_critic", lambda run, i: i == 3, lambda run: freeze_then_kill(run.critic.handles[1])
    )

    state = sync_rl(config, return_state=True)

    assert state.is_completed(), state.message
    assert [i for i, _ in killed] == [3]
    runs = stored_task_runs(state.state_details.flow_run_id)
    assert retried_task_runs(runs) == {"train_critic[rollout=3]": 2}
    assert {f"{task}[rollout={i}]" for i in range(5) for task in ("compute_values", "train_critic")} <= set(runs)
    assert sorted(RunDir(config.run_dir).critic().ledger().trained) == [0, 1, 2, 3, 4]
    gaps = _gaps(config.run_dir, reference.run_dir)
    print(f"critic of 2 workers, one killed, vs uninterrupted: policy {gaps[0]:.2e}, critic {gaps[1]:.2e}")
    assert max(gaps) < 1e-5


def test_the_async_flow_trains_with_a_critic_and_recovers_a_killed_one(
    ray_session, prefect_api, small_config, monkeypatch, tmp_path
):
    no_eval = "eval.datasets=[]"  # an evaluation beside a generation changes its batch mates, at float rounding
    reference = small_config(*GAE, no_eval, **RECOVERY_RUN, run_dir=str(tmp_path / "uninterrupted"))
    run_async(reference)
    config = small_config(*GAE, no_eval, **RECOVERY_RUN)
    killed = fault_before(
        monkeypatch, RLRun, "compute_values", lambda run, i: i == 3, lambda run: freeze_then_kill(run.critic.handles[0])
    )

    state = async_rl(config, return_state=True)

    assert state.is_completed(), state.message
    assert [i for i, _ in killed] == [3]
    runs = stored_task_runs(state.state_details.flow_run_id)
    assert retried_task_runs(runs) == {"compute_values[rollout=3]": 2}
    # the values of rollout i are the critic's after it trained on rollout i - 1
    for i in range(1, 5):
        assert runs[f"train_critic[rollout={i - 1}]"].end_time <= runs[f"compute_values[rollout={i}]"].start_time
    assert sorted(RunDir(config.run_dir).critic().ledger().trained) == [0, 1, 2, 3, 4]
    assert_same_samples(config.run_dir, reference.run_dir, range(5))
    gaps = _gaps(config.run_dir, reference.run_dir)
    print(f"async, critic killed, vs uninterrupted: policy {gaps[0]:.2e}, critic {gaps[1]:.2e}")
    assert max(gaps) < 1e-5
