"""The rl-sync flow end to end on the tiny model, read back from the Prefect API."""

import base64
import json
import os
import re
import signal
import threading
from pathlib import Path

import httpx
import ray
from prefect.client.orchestration import get_client

from flows.sync_rl import sync_rl
from miles.rollout.inference_controller import InferenceController
from miles.rollout.store import RolloutStore
from miles.run import RLRun
from miles.state.run_dir import RunDir
from tests.helpers import RECOVERY_RUN, final_weights, max_abs_diff, sglang_overrides
from tests.helpers.faults import assert_whole_rollouts, fault_before, freeze_then_kill, sglang_server_pid
from tests.helpers.history import flow_run_artifacts, retried_task_runs, stored_task_runs

CALCULATOR = ["data.task=sums", "rollout.env=calculator", "rollout.max_new_tokens=12", "eval.datasets=[]"]


def test_two_iterations_are_recorded_in_the_api(ray_session, prefect_api, small_config):
    config = small_config(
        "eval.interval=1", "eval.datasets=[{name: sums, task: addition, max_prompts: 20}]", num_rollout=2
    )
    state = sync_rl(config, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["rollouts_trained"] == 2 and summary["task_runs"] == 12
    assert [(r["rollout_id"], r["weight_version"], r["prompts"]) for r in summary["eval"]["sums"]] == [
        (0, 0, 20),
        (1, 1, 20),
        (2, 2, 20),
    ]

    flow_run_id = state.state_details.flow_run_id
    runs = stored_task_runs(flow_run_id)
    artifacts = flow_run_artifacts(flow_run_id)
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
    assert flow_run.flow_id is not None and flow_run.state.is_completed()
    expected = [f"{task}[rollout={i}]" for i in (0, 1) for task in ("generate", "get", "train_step", "sync_weights")]
    evaluations = {f"evaluate[rollout={i}]" for i in (0, 1, 2)}
    assert set(expected) | {"save_checkpoint[rollout=1]"} | evaluations == set(runs)
    assert all(r.state.is_completed() for r in runs.values())
    # Each evaluation runs on the weights the engines hold before that rollout is generated.
    for i in (0, 1):
        assert runs[f"evaluate[rollout={i}]"].end_time <= runs[f"generate[rollout={i}]"].start_time
    assert runs["sync_weights[rollout=1]"].end_time <= runs["evaluate[rollout=2]"].start_time
    assert {a.type for a in artifacts} >= {"progress", "table", "markdown"}
    summary = next(a for a in artifacts if a.key == "rl-sync-summary").data
    image = re.search(r"!\[reward curve of run\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", summary)
    assert image and base64.b64decode(image.group(1)) == (Path(config.run_dir) / "reward_curve.png").read_bytes()
    image = re.search(r"!\[eval sums of run\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", summary)
    assert image and base64.b64decode(image.group(1)) == (Path(config.run_dir) / "eval_sums.png").read_bytes()
    assert "| eval sums at rollout 2 | reward_mean" in summary
    tables = {a.key: json.loads(a.data) for a in sorted(artifacts, key=lambda a: a.created) if a.type == "table"}
    assert [row["rollout_id"] for row in tables["rl-sync-metrics"]] == [0, 1]
    assert [(row["rollout_id"], row["pass_at_1"]) for row in tables["eval-sums"]] == [
        (r["rollout_id"], round(r["pass_at_1"], 4)) for r in RunDir(config.run_dir).evaluations("sums")
    ]
    assert [r["rollout_id"] for r in RunDir(config.run_dir).metrics()] == [0, 1]


def test_a_killed_engine_and_a_killed_trainer_are_recovered_by_task_retries(
    ray_session, prefect_api, small_config, monkeypatch, uninterrupted_weights
):
    """With the distributed transport: the restarted engine, then the restarted trainer, make new weight groups."""
    config = small_config("rollout.weight_transport=distributed", **RECOVERY_RUN)
    engine_killed = fault_before(
        monkeypatch, RLRun, "generate", lambda run, i: i == 2, lambda run: freeze_then_kill(run.controller.engines[0])
    )
    # Rollout 2 is trained after checkpoint 1, so the restored trainer must replay it before training rollout 3.
    trainer_killed = fault_before(
        monkeypatch, RLRun, "train", lambda run, i: i == 3, lambda run: freeze_then_kill(run.trainer.handles[0])
    )

    state = sync_rl(config, return_state=True)

    assert state.is_completed(), state.message
    assert [i for i, _ in engine_killed] == [2] and [i for i, _ in trainer_killed] == [3]
    runs = stored_task_runs(state.state_details.flow_run_id)
    assert retried_task_runs(runs) == {"generate[rollout=2]": 2, "train_step[rollout=3]": 2}
    assert all(r.state.is_completed() for r in runs.values())
    assert sorted(RunDir(config.run_dir).ledger().trained) == [0, 1, 2, 3, 4]
    assert_whole_rollouts(config.run_dir, range(5), config.samples_per_rollout)
    # fp32 on the CPU, same seeds: every rollout applied exactly once gives the uninterrupted run's weights.
    assert max_abs_diff(final_weights(config.run_dir, 4), uninterrupted_weights) == 0.0


def test_a_killed_trainer_worker_takes_its_group_down_and_the_retry_restarts_the_group(
    ray_session, prefect_api, small_config, monkeypatch, uninterrupted_weights
):
    config = small_config("train.num_workers=2", **RECOVERY_RUN)
    worker_killed = fault_before(
        monkeypatch, RLRun, "train", lambda run, i: i == 3, lambda run: freeze_then_kill(run.trainer.handles[1])
    )

    state = sync_rl(config, return_state=True)

    assert state.is_completed(), state.message
    assert [i for i, _ in worker_killed] == [3]
    runs = stored_task_runs(state.state_details.flow_run_id)
    assert retried_task_runs(runs) == {"train_step[rollout=3]": 2}
    assert sorted(RunDir(config.run_dir).ledger().trained) == [0, 1, 2, 3, 4]
    gap = max_abs_diff(final_weights(config.run_dir, 4), uninterrupted_weights)
    print(f"2 workers, one killed, vs 1 worker uninterrupted: {gap:.2e}")
    assert gap < 1e-5


def test_the_sglang_engine_runs_the_flow_and_a_killed_server_is_replaced(
    ray_session, prefect_api, small_config, monkeypatch, uninterrupted_weights
):
    """rollout.engine=sglang, served by the stand-in server, weights broadcast over a weight-update group: the server
    is killed while rollout 2 generates, and a server dies receiving the weights trained on rollout 3. Each restarted
    server joins a new group and gets the trainer's weights."""
    config = small_config(
        *sglang_overrides(), "rollout.weight_transport=distributed", "rollout.engine_timeout_s=120", **RECOVERY_RUN
    )
    server_killed = fault_before(
        monkeypatch,
        RLRun,
        "generate",
        lambda run, i: i == 2,
        lambda run: _kill_during_next_call(sglang_server_pid(run.controller.engines[0])),
    )
    died_receiving = fault_before(
        monkeypatch, RLRun, "sync_weights", lambda run, i: i == 3, lambda run: _die_on_next_load(run.controller)
    )

    state = sync_rl(config, return_state=True)

    assert state.is_completed(), state.message
    assert [i for i, _ in server_killed] == [2] and [i for i, _ in died_receiving] == [3]
    runs = stored_task_runs(state.state_details.flow_run_id)
    assert retried_task_runs(runs) == {"generate[rollout=2]": 2, "sync_weights[rollout=3]": 2}
    assert sorted(RunDir(config.run_dir).ledger().trained) == [0, 1, 2, 3, 4]
    assert_whole_rollouts(config.run_dir, range(5), config.samples_per_rollout)
    # The stand-in samples with the same seeded TorchEngine: the run trains exactly as the torch-engine run does.
    assert max_abs_diff(final_weights(config.run_dir, 4), uninterrupted_weights) == 0.0


def _die_on_next_load(controller) -> int:
    """The stand-in server exits when the next weights arrive, as an SGLang server whose load failed can."""
    engine = controller.engines[0]
    url = ray.get(engine.__ray_call__.remote(lambda self: self.url))
    httpx.post(f"{url}/test_fault", json={"die_on_load": True}, trust_env=False).raise_for_status()
    return sglang_server_pid(engine)


def _kill_during_next_call(pid: int) -> int:
    """Stop the server now and kill it a second later, so the coming /generate is in flight when it dies."""
    os.killpg(pid, signal.SIGSTOP)
    threading.Timer(1.0, os.killpg, (pid, signal.SIGKILL)).start()
    return pid


def test_episodes_run_through_the_flow_on_either_engine_and_an_engine_killed_mid_episode_is_retried(
    ray_session, prefect_api, small_config, monkeypatch, tmp_path, tool_model_dir
):
    """The calculator task: the sync flow generates multi-turn episodes, on the TorchEngine and on SGLang (the
    stand-in). The engine is killed as the second turns of rollout 1's episodes go out: the generate task's retry
    runs the episodes again from their start, and the rollout is stored once. Both engines sample the same tokens."""
    kills = {
        "torch": lambda controller: freeze_then_kill(controller.engines[0]),
        "sglang": lambda controller: _kill_during_next_call(sglang_server_pid(controller.engines[0])),
    }
    real_generate = InferenceController.generate
    tables = {}
    for engine, kill in kills.items():
        calls, killed = [], []  # engine calls since rollout 1's generate began

        def generate(controller, requests, kill=kill, calls=calls, killed=killed):
            if calls and not killed:
                calls.append(len(requests))
                if len(calls) == 3:  # rollout 1's second call: its episodes' second turns
                    killed.append(kill(controller))
            return real_generate(controller, requests)

        overrides = sglang_overrides() if engine == "sglang" else []
        config = small_config(
            *CALCULATOR, f"model.path={tool_model_dir}", *overrides, run_dir=tmp_path / engine, save_interval=2
        )
        with monkeypatch.context() as patch:
            patch.setattr(InferenceController, "generate", generate)
            fault_before(patch, RLRun, "generate", lambda run, i: i == 1, lambda run, calls=calls: calls.append(0))
            state = sync_rl(config, return_state=True)

        assert state.is_completed(), state.message
        assert killed
        runs = stored_task_runs(state.state_details.flow_run_id)
        assert retried_task_runs(runs).keys() == {"generate[rollout=1]"}
        assert sorted(RunDir(config.run_dir).ledger().trained) == [0, 1]
        assert_whole_rollouts(config.run_dir, range(2), config.samples_per_rollout)
        tables[engine] = [RolloutStore(RunDir(config.run_dir).rollouts).read(i) for i in range(2)]
        assert max(tables[engine][1].column("num_turns").to_pylist()) > 1
    for column in ("response_ids", "loss_mask", "num_turns", "end_reason", "raw_reward"):
        assert [t.column(column) for t in tables["torch"]] == [t.column(column) for t in tables["sglang"]], column
