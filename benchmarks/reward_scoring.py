"""Reward scoring: `RewardScorer.score` (each call bounded by data.reward_timeout_s, at most data.reward_concurrency
at once) vs the standard library's unbounded pool (`ThreadPoolExecutor.map` with as many threads) over the same
plain reward and samples, and the bare loop as the floor.

A rollout of the embedded default is 512 samples (64 prompts x 8) scored by `exact_match`, a few string operations:
what the scorer costs on top is the driver's own time per rollout, on the critical path of every iteration. Each
side scores the same responses `--repeats` times, alternating; figures are medians.

Last line: `reward_scoring_vs_pool <RewardScorer ms / ThreadPoolExecutor.map ms>`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.smoke import parse_args
from miles.config import DataConfig
from miles.rewards import exact_match
from miles.rewards.scoring import RewardScorer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    args = parse_args(parser, samples=16, repeats=1)

    data = DataConfig()
    prompts = [f"{i % 100}+0=" for i in range(args.samples)]
    responses = [str(i % 200) for i in range(args.samples)]
    labels = [str(i % 100) for i in range(args.samples)]
    finished = [i % 7 != 0 for i in range(args.samples)]
    expected = [exact_match(r, la, f) for r, la, f in zip(responses, labels, finished, strict=True)]
    scorer = RewardScorer(exact_match, data.reward_timeout_s, data.reward_concurrency)

    def scored() -> list:
        rewards, failures = scorer.score(prompts, responses, labels, finished)
        assert not failures
        return rewards

    def pooled() -> list:
        with ThreadPoolExecutor(max_workers=data.reward_concurrency) as pool:
            return list(pool.map(exact_match, responses, labels, finished))

    def looped() -> list:
        return [exact_match(r, la, f) for r, la, f in zip(responses, labels, finished, strict=True)]

    sides = {"RewardScorer.score": scored, "ThreadPoolExecutor.map": pooled, "plain loop": looped}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for side in sides.values():
        assert side() == expected  # warm-up, and the same rewards on every side
    for _ in range(args.repeats):
        for name, side in sides.items():
            started = time.perf_counter()
            side()
            times[name].append(time.perf_counter() - started)
    medians = {name: 1000 * statistics.median(t) for name, t in times.items()}
    print(f"{args.samples} samples, exact_match, {data.reward_concurrency} threads, median of {args.repeats}")
    for name, ms in medians.items():
        print(f"  {name:24s} {ms:8.3f} ms  ({1000 * ms / args.samples:6.1f} us per sample)")
    print(f"reward_scoring_vs_pool {medians['RewardScorer.score'] / medians['ThreadPoolExecutor.map']:.2f}")


if __name__ == "__main__":
    main()
