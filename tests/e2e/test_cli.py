"""`miles run sync` as a user types it: a fresh process, its own ephemeral Prefect API and Ray."""

import os
import subprocess
import sys
from pathlib import Path

from miles.state.run_dir import RunDir

PROJECT = Path(__file__).resolve().parents[2]


def _miles(*args, cwd, timeout=300):
    """Run the CLI as a user would: no Prefect settings inherited from the test session."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env["PYTHONPATH"] = str(PROJECT)
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_bad_config_fails_before_any_work_and_names_the_field(tmp_path):
    out = _miles(
        "run", "sync", "--run-dir", str(tmp_path / "run"), "--set", "train.global_batch_size=100", cwd=tmp_path
    )
    assert out.returncode == 2
    assert "train.global_batch_size" in out.stderr
    assert not (tmp_path / "run").exists()

    out = _miles("run", "sync", "--set", "rollout.temperature=-1", cwd=tmp_path)
    assert out.returncode == 2 and "rollout.temperature" in out.stderr

    out = _miles("run", "async", "--set", "algo.use_tis=false", cwd=tmp_path)
    assert out.returncode == 2 and "algo.use_tis" in out.stderr

    out = _miles("run", "multi-lora", "--set", "adapters=[{name: x, global_batch_size: 7}]", cwd=tmp_path)
    assert out.returncode == 2 and "adapters.0" in out.stderr and "global_batch_size (7)" in out.stderr

    missing = tmp_path / "nope.jsonl"
    out = _miles(
        "run",
        "sync",
        "--set",
        "data.task=null",
        "--set",
        f"data.path={missing}",
        "--set",
        "model.path=/x",
        cwd=tmp_path,
    )
    assert out.returncode == 2 and str(missing) in out.stderr
    out = _miles(
        "run",
        "multi-lora",
        "--set",
        f"adapters=[{{name: x, data: {{task: null, path: {missing}}}}}]",
        "--set",
        "model.path=/x",
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "adapters.0 (x)" in out.stderr and str(missing) in out.stderr


def test_cli_runs_the_flow_with_a_project_local_prefect_home(tmp_path, tiny_model_dir):
    args = [
        "run",
        "sync",
        "--run-dir",
        str(tmp_path / "run"),
        "--num-rollout",
        "2",
        "--set",
        f"model.path={tiny_model_dir}",
        "--set",
        "rollout.rollout_batch_size=8",
        "--set",
        "rollout.n_samples_per_prompt=4",
        "--set",
        "train.global_batch_size=16",
        "--set",
        "train.micro_batch_size=16",
        "--set",
        "rollout.num_threads=1",
        "--set",
        "train.num_threads=1",
    ]
    out = _miles(*args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rollout 1/2  reward" in out.stdout and "rollout 2/2  reward" in out.stdout
    assert (tmp_path / ".prefect" / "prefect.db").exists()
    assert [r["rollout_id"] for r in RunDir(tmp_path / "run").metrics()] == [0, 1]


def test_plan_prints_where_each_actor_lands_on_a_simulated_node_and_what_each_gpu_holds(tmp_path):
    from transformers import Qwen2Config

    config = PROJECT / "deployments/configs/math-qwen2.5-7b-instruct.yaml"
    qwen_7b = Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, tie_word_embeddings=False, dtype="bfloat16",
    )  # fmt: skip
    qwen_7b.save_pretrained(tmp_path / "qwen")  # Qwen2.5-7B-Instruct's config.json, without its weights
    model = f"model.path={tmp_path / 'qwen'}"
    out = _miles("plan", "--config", str(config), "--simulate", "1x8", "--set", model, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    *lines, trainer, engine = out.stdout.strip().splitlines()
    assert trainer.startswith(
        "memory, trainer rank: 41.5 of 80 GiB (master weights 7.1, gradients 7.1, Adam moments 14.2"
    )
    assert engine == "memory, engine (and the KV cache SGLang sizes at start): 14.2 of 80 GiB (engine weights 14.2)"
    assert lines[0].split() == ["actor", "node", "GPUs", "CUDA_VISIBLE_DEVICES"]
    rows = [line.split() for line in lines[1:-1]]
    actors = [" ".join(row[:-3]) for row in rows]
    assert actors == [f"policy rank {i}" for i in range(4)] + [f"engine {i}" for i in range(4)]
    gpus = [row[-2] for row in rows]
    assert sorted(gpus) == [str(i) for i in range(8)]  # one GPU each, never two actors on one
    assert [row[-1] for row in rows] == gpus  # CUDA_VISIBLE_DEVICES as Ray assigned
    assert lines[-1] == "engines on GPUs of their own; weights reach the engines by distributed"
