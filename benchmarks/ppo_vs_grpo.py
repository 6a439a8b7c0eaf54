"""PPO with a critic (algo.advantage_estimator=gae) vs GRPO on the embedded task: the same warmed-up model, seed and
number of rollouts, run one after the other in one process (the plain sync loop).

For each: the sampled reward over the first and the last 20 rollouts, and the greedy accuracy on every sum of the
task (10,000) before and after training: on the default evaluation's 200 sums, the churn of greedy answers alone
moves a gain by a standard deviation of 0.04 (tests/helpers/learning.py), as much as the gains compared. PPO's
settings beyond the estimator: --ppo-set (by default a critic warm-up of 10 rollouts).

Last line: `ppo_vs_grpo_greedy_gain <PPO's gain in greedy accuracy / GRPO's>`.
"""

from __future__ import annotations

import argparse
import math
import tempfile

from benchmarks.smoke import TINY_RUN, parse_args
from miles.cluster.actors import ensure_ray
from miles.cluster.placement import ray_actors
from miles.config import load_config
from miles.loop import run_sync
from miles.state.run_dir import RunDir

PPO = ["algo.advantage_estimator=gae", "critic.warmup_rollouts=10"]
WHOLE_TASK_EVAL = "eval.datasets=[{name: addition, task: addition}]"


def _learning(overrides: list[str], rollouts: int, name: str) -> dict[str, float]:
    config = load_config(
        None, [WHOLE_TASK_EVAL, *overrides], run_dir=tempfile.mkdtemp(prefix=f"{name}-"), num_rollout=rollouts
    )
    run_sync(config)
    run_dir = RunDir(config.run_dir)
    rewards = [r["reward_mean"] for r in run_dir.metrics()]
    window = min(20, len(rewards))
    evaluations = run_dir.evaluations("addition")
    greedy = (evaluations[0]["reward_mean"], evaluations[-1]["reward_mean"]) if evaluations else (math.nan, math.nan)
    return {
        "first20": sum(rewards[:window]) / window,
        "last20": sum(rewards[-window:]) / window,
        "greedy_before": greedy[0],
        "greedy_after": greedy[1],
        "greedy_gain": greedy[1] - greedy[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=100)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override for both")
    parser.add_argument("--ppo-set", dest="ppo", action="append", default=None, help="PPO's own overrides")
    args = parse_args(parser, rollouts=2, overrides=TINY_RUN)
    ppo = [*args.overrides, *(args.ppo or PPO)]
    ensure_ray(None, actors=ray_actors(load_config(None, ppo), critic=True))  # room for the critic: one Ray for both
    figures = {
        "grpo": _learning(args.overrides, args.rollouts, "grpo"),
        "ppo": _learning(ppo, args.rollouts, "ppo"),
    }
    print(f"{'':6} {'first20':>8} {'last20':>8} {'greedy before':>14} {'greedy after':>13} {'greedy gain':>12}")
    for name, f in figures.items():
        print(
            f"{name:6} {f['first20']:8.3f} {f['last20']:8.3f} {f['greedy_before']:14.3f} {f['greedy_after']:13.3f} "
            f"{f['greedy_gain']:+12.3f}"
        )
    grpo_gain = figures["grpo"]["greedy_gain"]
    ratio = figures["ppo"]["greedy_gain"] / grpo_gain if grpo_gain else math.nan
    print(f"ppo_vs_grpo_greedy_gain {ratio:.3f}")


if __name__ == "__main__":
    main()
