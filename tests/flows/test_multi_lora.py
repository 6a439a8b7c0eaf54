"""The rl-multi-lora flow on the tiny model: adapters trained concurrently, retirement, PEFT checkpoints, resume."""

import json
from pathlib import Path

import pyarrow as pa
import torch
from peft import PeftConfig
from safetensors.torch import load_file

from flows.multi_lora import multi_lora
from miles.loop import run_multi_lora
from miles.multi_lora.run import AdapterRun, MultiLoRARun
from miles.state.run_dir import RunDir
from tests.helpers import max_abs_diff, sglang_overrides
from tests.helpers.faults import assert_same_samples, assert_whole_rollouts, fault_before, freeze_then_kill
from tests.helpers.history import flow_run_artifacts, retried_task_runs, stored_task_runs

ADAPTERS = [
    "adapters=[{name: add, data: {task: addition, reward: digit_match}, num_steps: 3, rollout_batch_size: 4,"
    " n_samples_per_prompt: 4, lr: 0.003},"
    " {name: sub, data: {task: subtraction, reward: digit_match}, num_steps: 2, rollout_batch_size: 2,"
    " n_samples_per_prompt: 4, global_batch_size: 4, rank: 4}]"
]


def _metrics(path: Path) -> list[dict]:
    return RunDir(path.parent).metrics()


def test_two_adapters_train_concurrently_retire_and_resume(ray_session, prefect_api, small_config):
    # Adapters go as PEFT tensors whatever carries full weights: the flow runs with the distributed transport set.
    config = small_config(*ADAPTERS, "rollout.weight_transport=distributed", save_interval=2)
    state = multi_lora(config, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert {name: s["rollouts_trained"] for name, s in summary.items()} == {"add": 3, "sub": 2}

    flow_run_id = state.state_details.flow_run_id
    runs = stored_task_runs(flow_run_id)
    names = set(runs)
    for adapter, steps in (("add", 3), ("sub", 2)):
        for i in range(steps):
            assert {f"{t}[{adapter}, rollout={i}]" for t in ("generate", "get", "train_step")} <= names
        # Pushed after every rollout, the last one for the final evaluation (before the adapter retires); evaluated
        # at the start and at the end, on its own task.
        assert {f"push_adapter[{adapter}, rollout={i}]" for i in range(steps)} <= names
        assert {
            f"retire_adapter[{adapter}]",
            f"evaluate[{adapter}, rollout=0]",
            f"evaluate[{adapter}, rollout={steps}]",
        } <= names
        evaluations = RunDir(Path(config.run_dir) / "adapters" / adapter).evaluations()
        expected = {"add": "addition", "sub": "subtraction"}[adapter]
        assert [(r["eval"], r["adapter"], r["rollout_id"], r["weight_version"]) for r in evaluations] == [
            (expected, adapter, 0, 0),
            (expected, adapter, steps, steps),
        ]
    assert all(r.state.is_completed() for r in runs.values())
    keys = {a.key for a in flow_run_artifacts(flow_run_id)}
    assert {
        "rl-multi-lora-add-progress",
        "rl-multi-lora-sub-progress",
        "rl-multi-lora-add-metrics",
        "rl-multi-lora-sub-summary",
    } <= keys

    run_dir = Path(config.run_dir)
    for adapter, steps, samples in (("add", 3, 16), ("sub", 2, 8)):
        adapter_dir = run_dir / "adapters" / adapter
        records = _metrics(adapter_dir / "metrics.jsonl")
        assert [(r["adapter"], r["rollout_id"]) for r in records] == [(adapter, i) for i in range(steps)]
        assert [r["weight_version"] for r in records] == list(
            range(steps)
        )  # rollout i sampled by the adapter after i steps
        assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in records)
        assert sorted(RunDir(adapter_dir).ledger().trained) == list(range(steps))
        table = pa.ipc.open_file(pa.memory_map(str(adapter_dir / "rollouts" / "rollout_0.arrow"))).read_all()
        assert table.num_rows == samples and set(table.column("adapter").to_pylist()) == {adapter}
        final = adapter_dir / "checkpoints" / str(steps - 1) / "adapter"
        assert PeftConfig.from_pretrained(str(final)).r == (4 if adapter == "sub" else 8)
        assert (final / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (run_dir / "adapters" / "add" / "checkpoints").iterdir()) == ["1", "2"]

    # One more step for "add": a new flow run resumes it after its checkpoint; "sub" is done and stays retired.
    more = small_config(*[ADAPTERS[0].replace("num_steps: 3", "num_steps: 4")], save_interval=2)
    state = multi_lora(more, return_state=True)
    assert state.is_completed(), state.message
    assert {name: s["rollouts_trained"] for name, s in state.result().items()} == {"add": 1}
    assert [r["rollout_id"] for r in _metrics(run_dir / "adapters" / "add" / "metrics.jsonl")] == [0, 1, 2, 3]
    starts = json.loads((run_dir / "run.json").read_text())["starts"]
    assert [s["rollout_id"] for s in starts] == [{"add": 0, "sub": 0}, {"add": 3, "sub": 2}]


def _adapter_weights(run_dir, adapter: str, rollout_id: int) -> dict:
    return load_file(
        str(
            Path(run_dir)
            / "adapters"
            / adapter
            / "checkpoints"
            / str(rollout_id)
            / "adapter"
            / "adapter_model.safetensors"
        )
    )


def test_killed_engine_and_killed_trainer_are_recovered_with_every_adapter(
    ray_session, prefect_api, small_config, monkeypatch, tmp_path
):
    reference = small_config(*ADAPTERS, run_dir=str(tmp_path / "uninterrupted"))
    # Each adapter's samples depend on its own seeds only, not on the interleaving; their log-probs on their batch
    # mates at float rounding (the engines batch whatever is in flight), and so the trained weights.
    run_multi_lora(reference)
    config = small_config(*ADAPTERS)  # no checkpoint before an adapter's last rollout: a restore replays its ledger
    fault_before(
        monkeypatch,
        AdapterRun,
        "generate",
        lambda adapter, i: (adapter.name, i) == ("sub", 1),
        lambda adapter: freeze_then_kill(adapter.controller.engines[0]),
    )
    fault_before(
        monkeypatch,
        AdapterRun,
        "train",
        lambda adapter, i: (adapter.name, i) == ("add", 2),
        lambda adapter: freeze_then_kill(adapter.trainer.handles[0]),
    )

    state = multi_lora(config, return_state=True)

    assert state.is_completed(), state.message
    runs = stored_task_runs(state.state_details.flow_run_id)
    retried = retried_task_runs(runs)
    # The engine dies as sub's generate(1) starts, the shared trainer as add's train_step(2) starts. Their calls
    # fail and are retried, and so is any other adapter's call on the same actor in flight then (an evaluation on
    # the engine; a push or a checkpoint reading the trainer); a call still queued behind a failed one finds the
    # restarted actor and runs once. Which is which depends on how the two branches interleave.
    assert "train_step[add, rollout=2]" in retried
    assert any(name.startswith(("generate[", "evaluate[", "push_adapter[")) for name in retried), retried
    on_actors = ("generate[", "evaluate[", "train_step[", "push_adapter[", "save_checkpoint[")
    assert all(name.startswith(on_actors) for name in retried), retried
    assert set(retried.values()) == {2}, retried
    assert all(r.state.is_completed() for r in runs.values())
    for adapter, steps, samples in (("add", 3, 16), ("sub", 2, 8)):
        adapter_dir = Path(config.run_dir) / "adapters" / adapter
        assert sorted(RunDir(adapter_dir).ledger().trained) == list(range(steps))
        assert_whole_rollouts(adapter_dir, range(steps), samples)
        assert_same_samples(adapter_dir, Path(reference.run_dir) / "adapters" / adapter, range(steps))
        assert (
            max_abs_diff(
                _adapter_weights(config.run_dir, adapter, steps - 1),
                _adapter_weights(reference.run_dir, adapter, steps - 1),
            )
            < 1e-4
        )


def test_sglang_engines_serve_the_adapters_as_the_torch_engines_do(ray_session, small_config, tmp_path):
    """The multi-LoRA loop with rollout.engine=sglang (the stand-in server, LoRA enabled from `adapters`): each
    adapter pushed as a PEFT directory trains as with the TorchEngine, to float rounding: the adapters generate
    side by side, as in the flow, so which requests share a batch varies from run to run. The weight transport of
    full pushes leaves adapters on their own path."""
    reference = small_config(*ADAPTERS, run_dir=str(tmp_path / "torch"))
    run_multi_lora(reference)
    config = small_config(
        *ADAPTERS, *sglang_overrides(), "rollout.weight_transport=distributed", run_dir=str(tmp_path / "sglang")
    )

    run_multi_lora(config)

    for adapter, steps in (("add", 3), ("sub", 2)):
        assert sorted(RunDir(config.run_dir).adapter(adapter).ledger().trained) == list(range(steps))
        # Batch mates differ from run to run, so single weights differ by Adam-normalised rounding (1.6e-5 seen on a
        # loaded machine), far below a step of train.lr=1e-3, as the restart test above bounds it.
        assert (
            max_abs_diff(
                _adapter_weights(config.run_dir, adapter, steps - 1),
                _adapter_weights(reference.run_dir, adapter, steps - 1),
            )
            < 1e-4
        )


def test_two_trainer_groups_on_a_sharded_bf16_base_and_a_killed_group_restarts_alone(
    ray_session, prefect_api, small_config, bf16_model_dir, monkeypatch, tmp_path
):
    """Each adapter on a trainer group of its own, two workers each sharding the bf16 base: a worker of sub's group
    dies in its train_step; that group alone restarts (from the ledger), add's group goes on, and both adapters end
    as in an uninterrupted run."""
    grouped = (
        ADAPTERS[0]
        .replace("lr: 0.003}", "lr: 0.003, trainer_group: first}")
        .replace("rank: 4}", "rank: 4, trainer_group: second}")
    )
    options = [grouped, f"model.path={bf16_model_dir}", "train.num_workers=2"]
    reference = small_config(*options, run_dir=str(tmp_path / "uninterrupted"))
    run_multi_lora(reference)
    started: list[str] = []
    restored = MultiLoRARun._restored_trainer_group
    monkeypatch.setattr(
        MultiLoRARun,
        "_restored_trainer_group",
        lambda run, group: started.append(group) or restored(run, group),
    )
    fault_before(
        monkeypatch,
        AdapterRun,
        "train",
        lambda adapter, i: (adapter.name, i) == ("sub", 1),
        lambda adapter: freeze_then_kill(adapter.trainer.handles[1]),
    )
    config = small_config(*options)

    state = multi_lora(config, return_state=True)

    assert state.is_completed(), state.message
    assert started == ["first", "second", "second"]
    assert "train_step[sub, rollout=1]" in retried_task_runs(stored_task_runs(state.state_details.flow_run_id))
    for adapter, steps, samples in (("add", 3, 16), ("sub", 2, 8)):
        adapter_dir = Path(config.run_dir) / "adapters" / adapter
        assert sorted(RunDir(adapter_dir).ledger().trained) == list(range(steps))
        assert_whole_rollouts(adapter_dir, range(steps), samples)
        final = _adapter_weights(config.run_dir, adapter, steps - 1)
        assert {value.dtype for value in final.values()} == {torch.float32}
        assert max_abs_diff(final, _adapter_weights(reference.run_dir, adapter, steps - 1)) < 1e-4


def test_a_failing_adapter_fails_its_own_branch_in_the_ui_and_the_others_finish(ray_session, prefect_api, small_config):
    """Its reward raises on every sample: its `get` fails (not retried: the data would fail again), it is retired, the
    other adapter trains to its end, and the flow run ends Failed naming the failed one."""
    raising = ADAPTERS[0].replace(
        " {name: sub, data: {task: subtraction, reward: digit_match}",
        " {name: sub, data: {task: subtraction, reward: tests.miles.rollout.rewards_for_tests:always_raises}",
    )
    config = small_config(raising)

    state = multi_lora(config, return_state=True)

    assert state.is_failed()
    assert "adapter sub failed: ValueError: rollout 0 has 0 samples after excluding 8 failed samples" in state.message
    runs = stored_task_runs(state.state_details.flow_run_id)
    assert runs["get[sub, rollout=0]"].state.is_failed()
    assert runs["retire_adapter[sub]"].state.is_completed()
    assert all(run.state.is_completed() for name, run in runs.items() if "[add" in name)
    assert sorted(RunDir(config.run_dir).adapter("add").ledger().trained) == [0, 1, 2]
    assert json.loads((Path(config.run_dir) / "tenants" / "sub.failed.json").read_text())["error"].startswith(
        "ValueError: rollout 0 has 0 samples"
    )
