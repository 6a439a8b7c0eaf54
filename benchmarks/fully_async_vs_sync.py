"""Fully-async vs sync: the same config and seed, as the plain sync loop and as the plain fully-async loop.

Workload with long-tailed response lengths: a randomly initialised Llama (hidden 128, 2 layers, the embedded
tokenizer's 16 tokens) samples until its EOS token, which a random model draws with probability about 1/16 at
each step, or until max_new_tokens (128): lengths are geometric, mean ~17, the 99th percentile ~85 and the
longest of a rollout's 512 samples ~110, so a generation's last steps decode a handful of rows. The reward is
digit_match on the addition prompts; what the model learns does not matter here, only the work. The sizes make
a generation and a train step take about the same time on one thread each.

The sync loop generates, then trains, then pushes; the fully-async loop keeps rollout.max_rollouts_in_flight
generations running beside the trainer, the engine batching all of them (continuous batching) and taking each
push between two decode steps. Engine and trainer get one torch thread each (2 cores). Iteration time is the wall
time between the first and the last iteration's end (actor start, model load and the first iteration excluded);
the engine's busy fraction is the share of that time it spent in decode steps.

Last line: `fully_async_speedup <sync s/iteration / fully-async s/iteration>`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import ray

from benchmarks.random_llama import random_llama
from benchmarks.smoke import TINY_RUN, parse_args
from miles import schedules
from miles.config import load_config
from miles.loop import plain_steps
from miles.run import RLRun
from miles.schedules import Steps

WORKLOAD = [
    "data.task=addition",
    "data.reward=digit_match",
    "rollout.rollout_batch_size=64",
    "rollout.n_samples_per_prompt=8",
    "rollout.max_new_tokens=128",
    "rollout.num_threads=1",
    "train.num_threads=1",
    "train.global_batch_size=512",
    "train.micro_batch_size=32",
    # A learning rate this small keeps the lengths where they start: both modes see the same workload throughout.
    "train.lr=1e-7",
    "save_interval=1000",
]


def _time_decode_steps(engine) -> None:
    """Run inside a TorchEngine's actor: its decode steps add up their seconds in `decode_seconds`."""
    step = engine._step
    engine.decode_seconds = 0.0

    def timed(admitted):
        started = time.perf_counter()
        try:
            return step(admitted)
        finally:
            engine.decode_seconds += time.perf_counter() - started

    engine._step = timed


def _busy_seconds(run: RLRun) -> float:
    return sum(ray.get([e.__ray_call__.remote(lambda engine: engine.decode_seconds) for e in run.controller.engines]))


def _measure(schedule: Callable[[RLRun, Steps], Iterator[int]], config) -> dict[str, float]:
    with RLRun(config) as run, plain_steps() as steps:
        ray.get([engine.__ray_call__.remote(_time_decode_steps) for engine in run.controller.engines])
        ends, busy, lengths = [], [], []
        for rollout_id in schedule(run, steps):
            record = run.finish_iteration(rollout_id)
            ends.append(record["finished_at"])
            busy.append(_busy_seconds(run))
            lengths.append(record["response_length_mean"])
    wall = ends[-1] - ends[0]
    return {
        "s_per_iteration": wall / (len(ends) - 1),
        "engine_busy_fraction": (busy[-1] - busy[0]) / wall,
        "response_length_mean": sum(lengths) / len(lengths),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    args = parse_args(parser, iterations=2, overrides=[*TINY_RUN, "rollout.max_new_tokens=8"])
    model = Path(tempfile.mkdtemp(prefix="random-llama-"))
    random_llama(model, hidden=128, layers=2, vocab=16, positions=512)
    overrides = [f"model.path={model}", *WORKLOAD, *args.overrides]
    results = {}
    for mode, schedule in (("sync", schedules.sync), ("fully-async", schedules.fully_async)):
        config = load_config(None, overrides, run_dir=tempfile.mkdtemp(prefix=f"{mode}-"), num_rollout=args.iterations)
        results[mode] = _measure(schedule, config)
        r = results[mode]
        print(
            f"{mode:<12} s/iteration {r['s_per_iteration']:.3f}  engine busy {r['engine_busy_fraction']:.2f}  "
            f"response length mean {r['response_length_mean']:.1f}",
            flush=True,
        )
    print(f"fully_async_speedup {results['sync']['s_per_iteration'] / results['fully-async']['s_per_iteration']:.2f}")


if __name__ == "__main__":
    main()
