"""Chaos soak: runs of rl-sync and rl-async that are killed with SIGKILL at random moments and must end as if nothing
had happened.

For each flow, `miles run <flow>` trains `--rollouts` rollouts of the embedded task (a small batch, two trainer
workers, a checkpoint every 5 rollouts) twice, against one Prefect server on 127.0.0.1: once uninterrupted, once with
`--kills` SIGKILLs at random moments (seeded: in random rollouts, a random part of a rollout's time into each), each
on one of: the engine's process, one trainer worker, the flow process (the CLI is then started again, as a user
would), the Prefect API server (started again on its port at once). Then it checks that:
- every rollout was trained exactly once: the ledger lists each rollout once, metrics.jsonl has one line per rollout;
- the final checkpoint's weights equal the uninterrupted run's, bit for bit (fp32 on the CPU);
- no process the run started is left (every process seen under the CLI is gone 20 s after it exits), and run.lock
  is free.
It prints each kill (what, when, in which rollout and call it landed) and what recovered it (a task retry with an
engine or trainer restart, a rerun of the CLI that resumed, the Prefect client riding out the server's restart).
A run that makes no progress for `--stall-s` is a failure: every wait must have a bound.

Last line: `chaos_kills <kills recovered from>`; the exit code is 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks.prefect_server import free_port
from benchmarks.smoke import UNTRAINED_MODEL, parse_args
from miles.state.run_dir import RunDir

TARGETS = ("engine", "trainer", "flow", "api")
RUN = [
    "rollout.rollout_batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.num_threads=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.num_threads=1",
    "train.num_workers=2",
    "eval.datasets=[]",
    "save_interval=5",
    "data.reward=digit_match",
]
# What a recovery prints, and what to call it.
RECOVERIES = {
    "restarted engines": "the engine restarted, the task retried",
    "restarting the trainer": "the trainer group restarted from its checkpoint, the task retried",
    "re-trained rollouts": "the rollouts since the checkpoint were re-trained",
}


class PrefectServer:
    """`prefect server start` on a fixed port, so that a flow process reaches it again after a restart."""

    def __init__(self, env: dict[str, str], log: Path):
        self.env, self.log, self.port = env, log, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        prefect = str(Path(sys.executable).with_name("prefect"))
        self.process = subprocess.Popen(
            [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.env,
            stdout=self.log.open("a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise SystemExit(f"the Prefect server did not start: {self.log}")

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@dataclass
class Kill:
    target: str
    at_s: float
    landed: str
    log_offset: int  # how much the CLI had printed by then: what it printed after is the recovery's
    recovered_by: list[str] = field(default_factory=list)


@dataclass
class Soak:
    flow: str
    run_dir: Path
    args: list[str]
    env: dict[str, str]
    logs: Path
    starts: int = 0
    seen: set[tuple[int, float]] = field(default_factory=set)  # (pid, create time) of every process under a CLI

    def start(self) -> subprocess.Popen:
        self.starts += 1
        log = (self.logs / f"{self.run_dir.name}-{self.starts}.log").open("w")
        command = [sys.executable, "-m", "flows.cli", "run", self.flow, "--run-dir", str(self.run_dir), *self.args]
        return subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        """What every start of the CLI printed, in order."""
        return "".join((self.logs / f"{self.run_dir.name}-{n}.log").read_text() for n in range(1, self.starts + 1))

    def watch(self, cli: subprocess.Popen) -> list[psutil.Process]:
        """The processes under the CLI now (remembered, to check that none outlives the run)."""
        try:
            found = psutil.Process(cli.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for process in found:
            try:
                self.seen.add((process.pid, process.create_time()))
            except psutil.NoSuchProcess:
                pass
        return found

    def trained(self) -> int:
        return len(RunDir(self.run_dir).ledger().trained)


def _titled(processes: list[psutil.Process], prefix: str) -> list[psutil.Process]:
    found = []
    for process in processes:
        try:
            if " ".join(process.cmdline()).startswith(prefix):
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


def run_uninterrupted(soak: Soak, stall_s: float) -> None:
    cli = soak.start()
    deadline = time.monotonic() + stall_s * 10
    while cli.poll() is None and time.monotonic() < deadline:
        soak.watch(cli)
        time.sleep(0.5)
    if cli.returncode != 0:
        cli.kill()
        raise SystemExit(f"the uninterrupted {soak.flow} run failed: {soak.log_text()[-3000:]}")


def run_with_kills(
    soak: Soak, server: PrefectServer, rollouts: int, plan: list[tuple[int, str]], rng: random.Random, stall_s: float
) -> tuple[list[Kill], list[str]]:
    """The run, with each planned kill (rollout, target) done once that many rollouts are trained, and one more since
    the last kill, after a random part of a rollout's time more: it lands in a random call of a rollout, or of a
    recovery."""
    kills: list[Kill] = []
    problems: list[str] = []
    started = time.monotonic()
    cli = soak.start()
    due_at = None
    progress, progress_at = -1, time.monotonic()
    trained_at_last_kill = -1
    step_s = 0.5  # how long a rollout takes, as last seen
    processes: list[psutil.Process] = []
    watched_at = 0.0
    while True:
        if time.monotonic() - watched_at > 0.5:  # listing Ray's processes takes a while: twice a second
            processes, watched_at = soak.watch(cli), time.monotonic()
        trained = soak.trained()
        if trained != progress:
            step_s = time.monotonic() - progress_at if trained == progress + 1 else step_s
            progress, progress_at = trained, time.monotonic()
        if cli.poll() is not None:
            if cli.returncode == 0 and trained == rollouts:
                break
            if kills:
                kills[-1].recovered_by.append(f"the CLI exited ({cli.returncode}); rerun, resumed at rollout {trained}")
            cli = soak.start()
            continue
        if time.monotonic() - progress_at > stall_s:
            problems.append(f"no rollout trained for {stall_s:.0f} s (at rollout {trained}): killed the CLI")
            cli.kill()
            cli.wait()
            progress_at = time.monotonic()
            continue
        if plan and due_at is None and max(plan[0][0], trained_at_last_kill + 1) <= trained < rollouts:
            due_at = time.monotonic() + rng.uniform(0, step_s)
        if due_at is not None and time.monotonic() >= due_at:
            target = plan[0][1]
            victim = _victim(target, cli, processes, server, rng)
            if victim is not None:
                plan.pop(0)
                due_at = None
                log_offset = len(soak.log_text())
                if target == "api":
                    server.kill()
                    server.start()
                else:
                    os.kill(victim[0], signal.SIGKILL)
                landed = f"rollout {trained} ({victim[1]})"
                kills.append(Kill(target, time.monotonic() - started, landed, log_offset))
                trained_at_last_kill = trained
        time.sleep(0.05)
    text = soak.log_text()
    for kill, end in zip(kills, [k.log_offset for k in kills[1:]] + [len(text)], strict=True):
        after = text[kill.log_offset : end]
        kill.recovered_by[:0] = [meaning for phrase, meaning in RECOVERIES.items() if phrase in after]
        if not kill.recovered_by:
            kill.recovered_by.append("the flow went on (a task's retry, or the Prefect client's)")
    return kills, problems


def _victim(target, cli, processes, server, rng) -> tuple[int, str] | None:
    """(pid, what it was doing) of the process to kill for `target`, or None when it is not there now."""
    if target == "flow":
        return cli.pid, "the flow process"
    if target == "api":
        return server.process.pid, "the Prefect API server"
    prefix = {"engine": "ray::TorchEngine", "trainer": "ray::TrainActor"}[target]
    found = _titled(processes, prefix)
    if not found:
        return None
    victim = rng.choice(found)
    try:
        return victim.pid, victim.cmdline()[0]
    except psutil.NoSuchProcess:
        return None


def check(soak: Soak, reference: Path, rollouts: int) -> list[str]:
    from safetensors.torch import load_file

    problems = []
    run_dir = RunDir(soak.run_dir)
    ledger = run_dir.ledger()
    lines = [json.loads(line)["rollout_id"] for line in run_dir.path.joinpath("ledger.jsonl").read_text().splitlines()]
    if sorted(ledger.trained) != list(range(rollouts)) or len(lines) != len(set(lines)):
        problems.append(f"the ledger lists {lines}, not each of 0..{rollouts - 1} once")
    metrics = [r["rollout_id"] for r in run_dir.metrics()]
    if metrics != list(range(rollouts)):
        problems.append(f"metrics.jsonl has rollouts {metrics}, not each of 0..{rollouts - 1} once")
    final = f"checkpoints/{rollouts - 1}/model/model.safetensors"
    ours, theirs = load_file(str(soak.run_dir / final)), load_file(str(reference / final))
    unequal = [name for name in theirs if not (ours[name] == theirs[name]).all()]
    if ours.keys() != theirs.keys() or unequal:
        problems.append(f"the final weights differ from the uninterrupted run's: {unequal[:5]}")
    deadline = time.monotonic() + 20
    while True:
        left = [pid for pid, created in soak.seen if _alive(pid, created)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if left:
        described = [" ".join(psutil.Process(pid).cmdline())[:80] for pid in left if psutil.pid_exists(pid)]
        problems.append(f"{len(left)} processes of the run are left: {described}")
    try:
        run_dir.lock().release()
    except RuntimeError as exc:
        problems.append(f"run.lock is not free: {exc}")
    return problems


def _alive(pid: int, created: float) -> bool:
    try:
        process = psutil.Process(pid)
        return process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=40, help="rollouts of each run")
    parser.add_argument("--kills", type=int, default=6, help="SIGKILLs in each flow's run")
    parser.add_argument("--flows", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    parser.add_argument("--model", help="model directory (default: the embedded model, warmed up)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kills' moments and targets")
    parser.add_argument("--stall-s", type=float, default=240.0, help="a run without progress this long fails")
    parser.add_argument("--workdir", help="where the runs go (default: a temporary directory)")
    args = parse_args(parser, rollouts=8, kills=4, flows=["sync"])
    if args.kills > args.rollouts - 2:
        parser.error(f"--kills {args.kills}: at most one kill per rollout between the first and the last")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(workdir / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    server = PrefectServer(env, workdir / "prefect-server.log")
    server.start()
    env["PREFECT_API_URL"] = server.api
    run_args = ["--num-rollout", str(args.rollouts), *(f"--set={o}" for o in RUN)]
    if args.model:
        run_args.append(f"--set=model.path={args.model}")
    elif args.smoke:
        run_args += [f"--set={o}" for o in UNTRAINED_MODEL]
    rng = random.Random(args.seed)
    recovered, failures = 0, []
    try:
        for flow in args.flows:
            reference = Soak(flow, workdir / f"{flow}-uninterrupted", run_args, env, workdir)
            run_uninterrupted(reference, args.stall_s)
            targets = [TARGETS[i % len(TARGETS)] for i in range(args.kills)]
            rng.shuffle(targets)
            plan = list(zip(sorted(rng.sample(range(1, args.rollouts - 1), args.kills)), targets, strict=True))
            soak = Soak(flow, workdir / f"{flow}-chaos", run_args, env, workdir)
            kills, problems = run_with_kills(soak, server, args.rollouts, plan, rng, args.stall_s)
            problems += check(soak, reference.run_dir, args.rollouts)
            print(f"rl-{flow}: {args.rollouts} rollouts, {len(kills)} kills, {soak.starts} starts of the CLI")
            for kill in kills:
                print(
                    f"  {kill.at_s:6.1f} s  SIGKILL {kill.target:8s} in {kill.landed}: {'; '.join(kill.recovered_by)}"
                )
            print(
                f"  {'FAILED: ' + '; '.join(problems) if problems else 'every rollout trained once, weights equal, nothing left, lock free'}"
            )
            failures += problems
            recovered += 0 if problems else len(kills)
    finally:
        server.kill()
    print(f"chaos_kills {recovered}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
