"""Async vs sync flow: the same config and seed, run as rl-sync and as rl-async in one process.

The async flow generates rollout i+1 while the trainer trains on rollout i, so an iteration costs about
max(generate, train) instead of generate + train. Engine and trainer get one torch thread each (2 cores);
the default sizes make generation and training take about the same time. Iteration time is the wall time
between the first and the last iteration's end (actor start and model load excluded).

Last line: `speedup <sync seconds per iteration / async seconds per iteration>`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from benchmarks.smoke import TINY_RUN, parse_args
from flows.runtime import configure_prefect

configure_prefect()

from flows.async_rl import async_rl  # noqa: E402
from flows.sync_rl import sync_rl  # noqa: E402
from miles.config import load_config  # noqa: E402
from miles.state.run_dir import RunDir

BALANCED = [
    "rollout.num_threads=1",
    "train.num_threads=1",
    # Generation is cheap per sample on this model; 16 samples per prompt and one optimizer step per rollout
    # bring generate and train_step to about the same time on one thread each.
    "rollout.rollout_batch_size=64",
    "rollout.n_samples_per_prompt=16",
    "train.global_batch_size=1024",
    "train.micro_batch_size=256",
]


def _measure(flow, overrides: list[str], iterations: int) -> dict[str, float]:
    config = load_config(None, overrides, run_dir=tempfile.mkdtemp(prefix=f"{flow.name}-"), num_rollout=iterations)
    state = flow(config, return_state=True)
    if not state.is_completed():
        raise SystemExit(f"{flow.name} ended {state.name}: {state.message}")
    records = RunDir(config.run_dir).metrics()
    return {
        "s_per_iteration": (records[-1]["finished_at"] - records[0]["finished_at"]) / (len(records) - 1),
        **{
            phase: statistics.mean(r[f"time_{phase}"] for r in records[1:])
            for phase in ("generate", "get", "train", "sync")
        },
        "reward_mean": statistics.mean(r["reward_mean"] for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    args = parse_args(parser, iterations=2, overrides=TINY_RUN)
    overrides = BALANCED + args.overrides

    sync = _measure(sync_rl, overrides, args.iterations)
    asynchronous = _measure(async_rl, overrides, args.iterations)
    print(f"{'':8} {'s/iter':>8} {'generate':>9} {'get':>7} {'train':>7} {'sync':>7} {'reward':>7}")
    for name, m in (("sync", sync), ("async", asynchronous)):
        print(
            f"{name:8} {m['s_per_iteration']:8.3f} {m['generate']:9.3f} {m['get']:7.3f} {m['train']:7.3f} {m['sync']:7.3f} {m['reward_mean']:7.3f}"
        )
    print(f"speedup {sync['s_per_iteration'] / asynchronous['s_per_iteration']:.3f}")


if __name__ == "__main__":
    main()
