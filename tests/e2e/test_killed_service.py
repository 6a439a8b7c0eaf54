"""SIGKILL of a `miles run multi-lora` service while a tenant trains, then the same command again: every adapter, the
configured one and the tenant, resumes where it was and ends with each rollout trained once."""

import json
import os
import signal
import subprocess
import sys

from miles.run_dir import RunDir
from tests.e2e.test_cli import PROJECT, _miles
from tests.helpers import small_overrides
from tests.helpers.waiting import eventually

SHAPE = ["rollout_batch_size=8", "n_samples_per_prompt=8", "lr=0.003", "eval.datasets=[]"]
SERVICE = [
    "adapters=[{name: add, data: {task: addition, reward: digit_match}, num_steps: 30, rollout_batch_size: 8,"
    " n_samples_per_prompt: 8, lr: 0.003, eval: {datasets: []}}]",
    "tenants.idle_timeout_s=2",
    "save_interval=2",
]


def _trained(run_dir, name: str) -> list[int]:
    return sorted(RunDir(run_dir).adapter(name).ledger().trained)


def test_a_killed_service_resumes_the_configured_adapter_and_the_tenant(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "service"
    overrides = [*small_overrides(tiny_model_dir), *SERVICE]
    args = [sys.executable, "-m", "flows.cli", "run", "multi-lora", "--run-dir", str(run_dir)]
    args += [part for override in overrides for part in ("--set", override)]
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env["PYTHONPATH"] = str(PROJECT)
    first = subprocess.Popen(
        args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        assert eventually(lambda: _trained(run_dir, "add"), timeout_s=240, every_s=0.1), "add never trained"
        tenant = ["--set", "name=late", "--set", "data.task=addition", "--set", "data.reward=digit_match"]
        tenant += ["--set", "num_steps=3", *[part for field in SHAPE for part in ("--set", field)]]
        submitted = _miles("tenant", "submit", str(run_dir), *tenant, cwd=tmp_path)
        assert submitted.returncode == 0, submitted.stderr
        assert eventually(lambda: _trained(run_dir, "late"), timeout_s=240, every_s=0.05), "the tenant never trained"
        os.killpg(first.pid, signal.SIGKILL)
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        first.wait(30)
    before = {name: _trained(run_dir, name) for name in ("add", "late")}
    assert len(before["add"]) < 30 and 1 <= len(before["late"]) < 3, before  # killed in the middle of both

    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    assert again.returncode == 0, again.stderr[-3000:]
    assert "stale lock" in again.stdout + again.stderr
    for name, steps in (("add", 30), ("late", 3)):
        assert _trained(run_dir, name) == list(range(steps))
        records = [r for r in RunDir(run_dir).adapter(name).metrics() if "eval" not in r]
        assert [r["rollout_id"] for r in records] == list(range(steps))  # each rollout's line once
    start = json.loads((run_dir / "run.json").read_text())["starts"][-1]["rollout_id"]
    assert start == {"add": len(before["add"]), "late": len(before["late"])}  # each after its last trained rollout
    listed = _miles("tenant", "list", str(run_dir), cwd=tmp_path)
    assert [line.split()[-1] for line in listed.stdout.splitlines()] == ["done", "done"]
