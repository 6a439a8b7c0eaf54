"""SIGKILL of the `miles run sync` process mid-run, then the same command again: the run resumes where it was."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from miles.loop import run_sync
from miles.state.run_dir import RunDir
from tests.e2e.test_cli import PROJECT
from tests.helpers import RECOVERY_RUN, final_weights, max_abs_diff, small_config_for, small_overrides
from tests.helpers.waiting import eventually


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every process under `root`."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                commands[int(entry.name)] = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found[child] = commands[child]
                frontier.append(child)
    return found


def _trainer_pid(root: int) -> int | None:
    return next((pid for pid, command in _descendants(root).items() if command.startswith("ray::TrainActor")), None)


def _metrics_ids(run_dir: Path) -> list[int]:
    return [r["rollout_id"] for r in RunDir(run_dir).metrics()]


# Rollouts big enough that training one takes about a second (four passes): the window in which the test freezes
# the trainer, between rollout 2's metrics line and the end of rollout 3's training.
BIGGER = [
    "rollout.rollout_batch_size=32",
    "rollout.n_samples_per_prompt=8",
    "train.global_batch_size=128",
    "train.micro_batch_size=32",
    "train.num_passes=4",
]


def test_killed_flow_process_resumes_at_the_right_rollout(ray_session, tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        "sync",
        "--run-dir",
        str(run_dir),
        "--num-rollout",
        str(RECOVERY_RUN["num_rollout"]),
        "--set",
        f"save_interval={RECOVERY_RUN['save_interval']}",
        *[part for override in small_overrides(tiny_model_dir) + BIGGER for part in ("--set", override)],
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env["PYTHONPATH"] = str(PROJECT)
    first = subprocess.Popen(
        args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        trainer = eventually(lambda: _trainer_pid(first.pid), timeout_s=240, every_s=0.2)
        assert trainer, "the trainer actor never started"
        # Once rollout 2 is finished, freeze the trainer: rollout 3 gets generated and stored, its training cannot end.
        assert eventually(lambda: 2 in _metrics_ids(run_dir), timeout_s=240, every_s=0.005), "rollout 2 never ended"
        os.kill(trainer, signal.SIGSTOP)
        rollout_3 = run_dir / "rollouts" / "rollout_3.arrow"
        assert eventually(rollout_3.exists, timeout_s=240), "rollout 3 was never stored"
        os.kill(first.pid, signal.SIGKILL)
    finally:
        try:  # what the killed process leaves behind (the frozen trainer) goes too; its API server dies with it
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        first.wait(30)

    assert sorted(RunDir(run_dir).ledger().trained) == [0, 1, 2]  # killed before rollout 3 was trained
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == first.pid  # a stale lock: its process is dead
    generated_at = rollout_3.stat().st_mtime_ns

    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    assert again.returncode == 0, again.stderr[-3000:]
    assert "stale lock" in again.stdout + again.stderr
    assert "rollout 4/5" in again.stdout and "rollout 5/5" in again.stdout and "rollout 3/5" not in again.stdout
    assert rollout_3.stat().st_mtime_ns == generated_at  # generated before the kill: reused, not regenerated
    assert sorted(RunDir(run_dir).ledger().trained) == [0, 1, 2, 3, 4]
    assert _metrics_ids(run_dir) == [0, 1, 2, 3, 4]
    starts = json.loads((run_dir / "run.json").read_text())["starts"]
    assert [(s["rollout_id"], s["replayed"]) for s in starts] == [(0, []), (3, [2])]
    assert not (run_dir / "run.lock").exists()
    reference = small_config_for(tiny_model_dir, tmp_path / "uninterrupted", *BIGGER, **RECOVERY_RUN)
    run_sync(reference)
    assert max_abs_diff(final_weights(run_dir, 4), final_weights(reference.run_dir, 4)) == 0.0
