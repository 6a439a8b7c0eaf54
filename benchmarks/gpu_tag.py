"""The `gpu` tag on `generate` under a tag concurrency limit, on a Prefect server backed by PostgreSQL (or SQLite).

A Prefect server on 127.0.0.1 with its database (`--database postgres`: a fresh cluster from deployments/postgres.py;
`sqlite`: the server's default), a concurrency limit on the tag (`--limit`, default 1), and one RLRun at the default
config (and `--set` overrides) driven in alternating blocks: the plain loop, the sync flow's tasks, and the same
with `generate` tagged (each tagged task run takes and releases a slot through the API). Same probe as
orchestration_overhead.py.

Last line: `gpu_tag_ratio <tagged flow s/iteration / untagged flow s/iteration>`; the line before it gives both
flows' overhead ratios against the plain loop.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.prefect_server import free_port, prefect_server
from benchmarks.smoke import TINY_RUN, parse_args
from deployments import postgres

TAG = "gpu"


def _measure(api: str, workdir: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Alternating blocks on one RLRun, against the server at `api`: seconds per iteration of each side."""
    httpx.post(f"{api}/concurrency_limits/", json={"tag": TAG, "concurrency_limit": args.limit}).raise_for_status()
    os.environ.update(PREFECT_API_URL=api, PREFECT_HOME=str(workdir / "prefect"))
    from prefect.logging.handlers import APILogWorker

    from benchmarks.orchestration_overhead import probe  # imports prefect: after PREFECT_API_URL is set
    from miles import schedules
    from miles.config import load_config
    from miles.loop import plain_steps
    from miles.run import RLRun

    per_block = args.iterations
    total = per_block * (3 * args.rounds + 1)
    config = load_config(
        None, args.overrides, run_dir=str(workdir / "run"), num_rollout=total + 1, save_interval=total + 1
    )
    times: dict[str, list[float]] = {"plain": [], "flow": [], "tagged": []}
    with RLRun(config) as run, plain_steps() as steps:
        ids = iter(run.rollout_ids())
        schedules.sync_iteration(run, steps, next(ids))  # warm the actors
        probe(run, [next(ids) for _ in range(per_block - 1)], [TAG])  # warm the client and the server
        for _ in range(args.rounds):
            for side in times:
                block = [next(ids) for _ in range(per_block)]
                started = time.perf_counter()
                if side == "plain":
                    for rollout_id in block:
                        schedules.sync_iteration(run, steps, rollout_id)
                else:
                    probe(run, block, [TAG] if side == "tagged" else None)
                times[side].append((time.perf_counter() - started) / per_block)
    # The flows' last logs go now, while the server runs: at exit Prefect would retry them against a stopped server
    # for about a minute.
    APILogWorker.drain_all()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument("--limit", type=int, default=1, help="concurrency limit on the tag")
    parser.add_argument("--iterations", type=int, default=20, help="iterations per block")
    parser.add_argument("--rounds", type=int, default=2, help="plain + untagged + tagged block triples")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    args = parse_args(parser, iterations=2, rounds=1, overrides=TINY_RUN)

    workdir = Path(tempfile.mkdtemp(prefix="gpu-tag-"))
    # Not under workdir, which only its owner may enter: PostgreSQL runs as its own user when root starts it.
    database_dir = Path(tempfile.mkdtemp(prefix="gpu-tag-postgres-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(workdir / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    if args.database == "postgres":
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = postgres.start(database_dir, free_port())
    try:
        with prefect_server(env, workdir / "server.log") as api:
            times = _measure(api, workdir, args)
    finally:
        if args.database == "postgres":
            postgres.stop(database_dir)
        for directory in (workdir, database_dir):
            shutil.rmtree(directory, ignore_errors=True)

    per_block = args.iterations
    mean = {side: statistics.mean(values) for side, values in times.items()}
    print(f"database {args.database}, concurrency limit {args.limit} on {TAG!r}, {per_block} x {args.rounds} per side")
    for side, values in times.items():
        print(f"{side:<8} s/iteration {mean[side]:.4f}  (blocks: {', '.join(f'{t:.4f}' for t in values)})")
    print(f"overhead_ratio untagged {mean['flow'] / mean['plain']:.3f}, tagged {mean['tagged'] / mean['plain']:.3f}")
    print(f"gpu_tag_ratio {mean['tagged'] / mean['flow']:.3f}")


if __name__ == "__main__":
    main()
