"""Start-up: the time from `miles run sync` to the first `generate` starting, and where it goes.

Runs the CLI as a user would (a fresh process, a fresh project-local PREFECT_HOME, its own ephemeral Prefect API
and Ray) on the embedded model for one rollout, then reads the flow run's and the first task run's start times
from the Prefect database. Alongside, each start-up piece is timed alone in a fresh process: Python with the
CLI's imports, the flow's imports (Prefect, torch, transformers, Ray), starting the ephemeral Prefect API,
starting Ray, loading the model. The command runs twice in one project dir: first with a new Prefect database (its migrations run), then
with that database in place, as on every later run; `--set` overrides go to both runs and to the embedded model's
build. The last line is `startup_seconds <launch to first generate, the later run>`.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.smoke import TINY_RUN, parse_args
from miles.config import load_config
from miles.models import ensure_embedded_model

PROJECT = Path(__file__).resolve().parents[1]

PROBES = {
    "python + CLI imports (config, argparse)": "import flows.cli, miles.config",
    "flow imports (prefect, torch, transformers, ray)": "import flows.sync_rl",
    "ephemeral Prefect API start": (
        "import time; from flows.runtime import configure_prefect; configure_prefect(); "
        "from prefect.client.orchestration import get_client; t = time.perf_counter(); "
        "c = get_client(sync_client=True).__enter__(); c.api_healthcheck(); print('piece', time.perf_counter() - t)"
    ),
    "Ray start (2 actors' CPUs)": (
        "import ray, time; from miles.cluster.actors import ensure_ray; t = time.perf_counter(); ensure_ray(None, actors=2); "
        "print('piece', time.perf_counter() - t)"
    ),
}


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env.update(PYTHONPATH=str(PROJECT), PREFECT_HOME=str(home / ".prefect"))
    return env


def _probe(code: str, home: Path) -> float:
    """Seconds of the piece: what the code prints as `piece <s>`, else the whole process's wall time."""
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=home, env=_env(home), capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - started
    pieces = [float(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("piece ")]
    return pieces[0] if pieces else wall


def _model_load(model_dir: str, home: Path) -> float:
    code = (
        "import time, torch; from transformers import AutoModelForCausalLM, AutoTokenizer; t = time.perf_counter(); "
        f"AutoModelForCausalLM.from_pretrained({model_dir!r}, dtype=torch.float32); AutoTokenizer.from_pretrained({model_dir!r}); "
        "print('piece', time.perf_counter() - t)"
    )
    return _probe(code, home)


def _timestamp(value: str) -> float:
    return datetime.fromisoformat(value).replace(tzinfo=UTC).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model dir (default: the embedded model, built once into the model cache)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    args = parse_args(parser, overrides=TINY_RUN)
    config = load_config(None, args.overrides)
    model = args.model or str(ensure_embedded_model(config.model, ["addition"], config.seed))
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        launches = {}
        for launch in ("first run (new Prefect database)", "next run (the project's database exists)"):
            launches[launch] = _launch(home, model, f"run{len(launches)}", args.overrides)
        pieces = {}
        for index, (name, code) in enumerate(PROBES.items()):  # each in its own dir: a fresh Prefect database
            (home / f"probe{index}").mkdir()
            pieces[name] = _probe(code, home / f"probe{index}")
        pieces["model load (transformers, one process)"] = _model_load(model, home)

    print("each piece alone, in a fresh process:")
    for name, seconds in pieces.items():
        print(f"  {name:<58} {seconds:6.2f} s")
    for launch, (to_flow, to_generate, whole) in launches.items():
        print(f"miles run sync --num-rollout 1, {launch}:")
        print(f"  {'launch -> flow run starts':<58} {to_flow:6.2f} s")
        print(
            f"  {'flow run starts -> first generate (RLRun: Ray, actors, models)':<58} {to_generate - to_flow:6.2f} s"
        )
        print(f"  {'whole command (one rollout, evaluation, exit)':<58} {whole:6.2f} s")
    print(f"startup_seconds {to_generate:.2f}")


def _launch(home: Path, model: str, run_dir: str, overrides: list[str]) -> tuple[float, float, float]:
    """Run the CLI for one rollout; seconds from launch to the flow run's start, to the first generate's start,
    and to the command's exit."""
    launched = time.time()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "sync",
            "--run-dir",
            str(home / run_dir),
            "--num-rollout",
            "1",
            "--set",
            f"model.path={model}",
            "--set",
            "rollout.num_threads=1",
            "--set",
            "train.num_threads=1",
            *(flag for override in overrides for flag in ("--set", override)),
        ],
        cwd=home,
        env=_env(home),
        capture_output=True,
        text=True,
    )
    finished = time.time()
    if run.returncode:
        sys.exit(run.stderr[-3000:])
    with sqlite3.connect(home / ".prefect" / "prefect.db") as db:
        (flow_start,) = db.execute("select start_time from flow_run order by created desc").fetchone()
        (generate_start,) = db.execute(
            "select start_time from task_run where name = 'generate[rollout=0]' order by created desc"
        ).fetchone()
    return _timestamp(flow_start) - launched, _timestamp(generate_start) - launched, finished - launched


if __name__ == "__main__":
    main()
