"""The rl-multi-lora flow on the tiny model: concurrent adapter branches, retirement, PEFT checkpoints, resume."""

import asyncio
import json
from pathlib import Path

import pyarrow as pa
from peft import PeftConfig
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter

from flows.multi_lora import multi_lora
from miles.checkpoint import Ledger

ADAPTERS = [
    "adapters=[{name: add, data: {task: addition, reward: digit_match}, num_steps: 3, rollout_batch_size: 4,"
    " n_samples_per_prompt: 4, lr: 0.003},"
    " {name: sub, data: {task: subtraction, reward: digit_match}, num_steps: 2, rollout_batch_size: 2,"
    " n_samples_per_prompt: 4, global_batch_size: 4, rank: 4}]"
]


async def _history(flow_run_id):
    async with get_client() as client:
        task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
        artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": [flow_run_id]}))
    return task_runs, artifacts


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_adapters_train_concurrently_retire_and_resume(ray_session, prefect_api, small_config):
    config = small_config(*ADAPTERS, save_interval=2)
    state = multi_lora(config, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert {name: s["rollouts_trained"] for name, s in summary.items()} == {"add": 3, "sub": 2}

    task_runs, artifacts = asyncio.run(_history(state.state_details.flow_run_id))
    names = {r.name for r in task_runs}
    for adapter, steps in (("add", 3), ("sub", 2)):
        for i in range(steps):
            assert {f"{t}[{adapter}, rollout={i}]" for t in ("generate", "get", "train_step")} <= names
        # Pushed after every rollout but the last, which retires the adapter instead.
        assert {f"push_adapter[{adapter}, rollout={i}]" for i in range(steps - 1)} <= names
        assert f"push_adapter[{adapter}, rollout={steps - 1}]" not in names
        assert {f"retire_adapter[{adapter}]", f"evaluate[{adapter}, rollout={steps - 1}]"} <= names
    assert all(r.state.is_completed() for r in task_runs)
    keys = {a.key for a in artifacts}
    assert {"rl-multi-lora-add-progress", "rl-multi-lora-sub-progress", "rl-multi-lora-add-metrics", "rl-multi-lora-sub-summary"} <= keys

    run_dir = Path(config.run_dir)
    for adapter, steps, samples in (("add", 3, 16), ("sub", 2, 8)):
        adapter_dir = run_dir / "adapters" / adapter
        records = _metrics(adapter_dir / "metrics.jsonl")
        assert [(r["adapter"], r["rollout_id"]) for r in records] == [(adapter, i) for i in range(steps)]
        assert [r["weight_version"] for r in records] == list(range(steps))  # rollout i sampled by the adapter after i steps
        assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in records)
        assert sorted(Ledger(adapter_dir).trained) == list(range(steps))
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
