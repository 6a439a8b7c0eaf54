"""SIGKILL of a `miles run multi-lora` service while a tenant trains, then the same command again: nothing of the killed
service is left, and every adapter, the configured one and the tenant, resumes where it was and ends with each rollout
trained once."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from miles.cluster.actors import RUN_MARK
from miles.state.run_dir import RunDir
from tests.e2e.test_cli import PROJECT, _miles
from tests.helpers import small_overrides
from tests.helpers.waiting import eventually
from tests.miles.test_ray_local import alive

# The configured adapter's rollouts take about a quarter of a second each: its budget outlasts a tenant submission
# (a CLI process of its own, several seconds) a few times over. The tenant's budget leaves a window of seconds
# between its first trained rollout and its last, in which the service is killed.
ADD_STEPS, LATE_STEPS = 100, 12
SHAPE = ["rollout_batch_size=8", "n_samples_per_prompt=8", "lr=0.003", "eval.datasets=[]"]
SERVICE = [
    f"adapters=[{{name: add, data: {{task: addition, reward: digit_match}}, num_steps: {ADD_STEPS},"
    " rollout_batch_size: 8, n_samples_per_prompt: 8, lr: 0.003, eval: {datasets: []}}]",
    "tenants.idle_timeout_s=2",
    "save_interval=5",
]


def _trained(run_dir, name: str) -> list[int]:
    return sorted(RunDir(run_dir).adapter(name).ledger().trained)


def _environ(pid: int) -> bytes:
    try:
        return b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _ray_mark(processes: list[psutil.Process]) -> bytes | None:
    """The run mark (MILES_RAY_RUN=id) that the service's local Ray processes carry in their environment, as it
    appears in /proc/PID/environ between NULs."""
    for process in processes:
        for entry in _environ(process.pid).split(b"\0"):
            if entry.startswith(f"{RUN_MARK}=".encode()):
                return b"\0" + entry + b"\0"
    return None


def _left(service: list[psutil.Process], session: int, mark: bytes) -> list[str]:
    """What still lives of the killed service: its processes as seen before the kill, any process of its session,
    and any carrying its Ray mark (whoever its parent is by now)."""
    found = {process.pid: process for process in alive(service)}
    for process in alive(list(psutil.process_iter())):
        try:
            if process.pid != os.getpid() and (os.getsid(process.pid) == session or mark in _environ(process.pid)):
                found[process.pid] = process
        except OSError:
            continue
    left = []
    for process in found.values():
        try:
            left.append(f"{process.pid} {' '.join(process.cmdline()) or process.name()}")
        except psutil.NoSuchProcess:
            continue
    return left


def test_a_killed_service_leaves_nothing_and_resumes_the_configured_adapter_and_the_tenant(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "service"
    overrides = [*small_overrides(tiny_model_dir), *SERVICE]
    args = [sys.executable, "-m", "flows.cli", "run", "multi-lora", "--run-dir", str(run_dir)]
    args += [part for override in overrides for part in ("--set", override)]
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env["PYTHONPATH"] = str(PROJECT)
    tenant = ["--set", "name=late", "--set", "data.task=addition", "--set", "data.reward=digit_match"]
    tenant += ["--set", f"num_steps={LATE_STEPS}", *[part for field in SHAPE for part in ("--set", field)]]
    first = subprocess.Popen(
        args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    submit = None
    service: list[psutil.Process] = []
    try:
        eventually(lambda: _trained(run_dir, "add") or first.poll() is not None, timeout_s=240, every_s=0.1)
        assert first.poll() is None and _trained(run_dir, "add"), f"add never trained (exit code {first.poll()})"
        submit = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "tenant", "submit", str(run_dir), *tenant],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert eventually(
            lambda: _trained(run_dir, "late") or submit.poll() not in (None, 0), timeout_s=240, every_s=0.02
        ), "the tenant never trained"
        service = [psutil.Process(first.pid), *psutil.Process(first.pid).children(recursive=True)]
        mark = _ray_mark(service)
        os.killpg(first.pid, signal.SIGKILL)
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        first.wait(30)
        if submit is not None:
            submitted = submit.communicate(timeout=120)
    assert submit.returncode == 0, submitted
    assert mark, "no process of the service carries a local Ray's mark"
    # Ray's workers are in process groups of their own: the run's reaper kills them once the service is gone.
    eventually(lambda: not _left(service, first.pid, mark), timeout_s=60, every_s=0.2)
    assert not _left(service, first.pid, mark)

    before = {name: _trained(run_dir, name) for name in ("add", "late")}
    assert len(before["add"]) < ADD_STEPS and 1 <= len(before["late"]) < LATE_STEPS, before  # killed mid-way in both

    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    assert again.returncode == 0, again.stderr[-3000:]
    assert "stale lock" in again.stdout + again.stderr
    for name, steps in (("add", ADD_STEPS), ("late", LATE_STEPS)):
        assert _trained(run_dir, name) == list(range(steps))
        assert [r["rollout_id"] for r in RunDir(run_dir).adapter(name).metrics()] == list(range(steps))  # once each
    start = json.loads((run_dir / "run.json").read_text())["starts"][-1]["rollout_id"]
    assert start == {"add": len(before["add"]), "late": len(before["late"])}  # each after its last trained rollout
    assert start["late"] > 0
    listed = _miles("tenant", "list", str(run_dir), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    states = {line.split()[0]: line.split()[-1] for line in listed.stdout.splitlines()}
    assert states == {"add": "done", "late": "done"}, listed.stdout
