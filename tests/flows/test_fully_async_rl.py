"""The rl-fully-async flow: generation runs up to rollout.max_rollouts_in_flight rollouts ahead of training, read
back from the Prefect API and the run directory."""

from flows.fully_async_rl import fully_async_rl
from miles.rollout.schema import rollout_metadata
from miles.rollout.store import RolloutStore
from miles.run import RLRun
from miles.state.run_dir import RunDir
from tests.helpers import RECOVERY_RUN
from tests.helpers.faults import assert_whole_rollouts, fault_before, freeze_then_kill
from tests.helpers.history import stored_task_runs


def _data_ends(run_dir, rollout_ids) -> list[int]:
    store = RolloutStore(RunDir(run_dir).rollouts)
    return [int(rollout_metadata(store.read(i))["data_position_end"]) for i in rollout_ids]


def test_generation_runs_ahead_of_training_by_the_window(ray_session, prefect_api, small_config):
    config = small_config("rollout.max_rollouts_in_flight=2", num_rollout=4)
    state = fully_async_rl(config, return_state=True)
    assert state.is_completed(), state.message
    runs = stored_task_runs(state.state_details.flow_run_id)

    assert all(r.state.is_completed() for r in runs.values())
    assert state.result()["task_runs"] == len(runs) == 4 * 4 + 3  # + the final checkpoint and two evaluations
    for i in (0, 1):  # rollout i + 2 is generated while the trainer steps on rollout i
        assert runs[f"generate[rollout={i + 2}]"].start_time < runs[f"train_step[rollout={i}]"].end_time
        assert runs[f"generate[rollout={i + 2}]"].start_time >= runs[f"get[rollout={i}]"].end_time
    metrics = RunDir(config.run_dir).metrics()
    assert [m["rollout_id"] for m in metrics] == [0, 1, 2, 3]
    # Rollouts 0 and 1 come from the starting weights; each later one from weights at most two versions behind.
    assert [m["weight_version"] for m in metrics[:2]] == [0, 0]
    assert all(m["token_staleness_max"] <= 2 and 0 <= m["mixed_version_samples"] for m in metrics)
    assert [m["staleness_mean"] for m in metrics[:2]] == [0.0, 1.0]
    assert _data_ends(config.run_dir, range(4)) == [8, 16, 24, 32]  # consecutive prompts, 8 per rollout


def test_fully_async_flow_recovers_from_a_killed_engine_and_a_killed_trainer(
    ray_session, prefect_api, small_config, monkeypatch
):
    config = small_config("rollout.max_rollouts_in_flight=2", **RECOVERY_RUN)
    fault_before(
        monkeypatch, RLRun, "generate", lambda run, i: i == 2, lambda run: freeze_then_kill(run.controller.engines[0])
    )
    fault_before(
        monkeypatch, RLRun, "train", lambda run, i: i == 3, lambda run: freeze_then_kill(run.trainer.handles[0])
    )

    state = fully_async_rl(config, return_state=True)

    assert state.is_completed(), state.message
    runs = stored_task_runs(state.state_details.flow_run_id)
    assert runs["generate[rollout=2]"].run_count == 2 and runs["train_step[rollout=3]"].run_count == 2
    assert sorted(RunDir(config.run_dir).ledger().trained) == [0, 1, 2, 3, 4]
    assert [m["rollout_id"] for m in RunDir(config.run_dir).metrics()] == [0, 1, 2, 3, 4]  # each trained once
    assert_whole_rollouts(config.run_dir, range(5), config.samples_per_rollout)
    assert _data_ends(config.run_dir, range(5)) == [8, 16, 24, 32, 40]


def test_a_resumed_run_trains_the_rollouts_generated_ahead_from_their_files(
    ray_session, prefect_api, small_config, monkeypatch
):
    """The first run stops at train_step(2) with rollouts 2 and 3 stored, untrained: the next run trains them from
    their files (not regenerated) and goes on from the prompts after rollout 3."""
    config = small_config("rollout.max_rollouts_in_flight=2", num_rollout=5, save_interval=2)

    def refuse(run):
        raise ValueError("stop here")

    fault_before(monkeypatch, RLRun, "train", lambda run, i: i == 2, refuse)
    assert fully_async_rl(config, return_state=True).is_failed()
    store = RolloutStore(RunDir(config.run_dir).rollouts)
    stored = {i: store.read(i) for i in (2, 3)}
    assert sorted(RunDir(config.run_dir).ledger().trained) == [0, 1]
    monkeypatch.undo()

    state = fully_async_rl(config, return_state=True)

    assert state.is_completed(), state.message
    for i, table in stored.items():
        assert store.read(i).equals(table)
    assert sorted(RunDir(config.run_dir).ledger().trained) == [0, 1, 2, 3, 4]
    assert [m["rollout_id"] for m in RunDir(config.run_dir).metrics()] == [0, 1, 2, 3, 4]
    assert _data_ends(config.run_dir, range(5)) == [8, 16, 24, 32, 40]
