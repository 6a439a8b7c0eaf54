"""Episode batching: turns per second of 256 concurrent episodes of 4 turns, run together by the episode runner,
vs the same episodes run one at a time through the same engine.

Both sides use one TorchEngine in this process (no Ray: the controller's merging of concurrent callers is not
what is measured) on the embedded model (built once per `--set model...` and cached), the same episode seeds
and the same environment: a quiz whose every reply is a new sum, done after 4 model turns. With the same seeds
both sides generate the same tokens, so they run the same turns (checked). Sides alternate, `--repeats` times each;
turns/s = turns / median wall seconds.

Last line: `episode_batching_speedup <batched turns/s / one-at-a-time turns/s>` (goal: >= 5).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoTokenizer

from benchmarks.smoke import UNTRAINED_MODEL, parse_args
from miles.config import load_config
from miles.engines.base import SamplingParams, eos_token_ids
from miles.engines.torch_engine import TorchEngine
from miles.envs.base import StepResult
from miles.models import ensure_embedded_model
from miles.rollout.episodes import EpisodeRunner
from miles.rollout.generation import GenerateClient, RolloutSample

TURNS = 4


class FourSums:
    """Replies to every turn with the next sum; done after TURNS model turns."""

    def __init__(self, row: dict):
        self.prompt = row["prompt"]
        self.turns = 0

    def reset(self) -> str:
        return self.prompt

    def step(self, model_turn: str) -> StepResult:
        self.turns += 1
        return StepResult(observation=f"{self.turns}+{self.turns}=", done=self.turns == TURNS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    args = parse_args(parser, episodes=4, repeats=1, threads=1, overrides=UNTRAINED_MODEL)
    torch.set_num_threads(args.threads)

    config = load_config(None, [f"rollout.max_turns={TURNS}", *args.overrides])
    model_dir = ensure_embedded_model(config.model, ["addition"], config.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = TorchEngine(str(model_dir), num_threads=args.threads)
    runner = EpisodeRunner(GenerateClient(engine, tokenizer, config, None), FourSums)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=eos_token_ids(tokenizer))
    samples = [
        RolloutSample(row={"prompt": f"{k % 100}+{(k * 7) % 100}=", "label": ""}, seed=k, sampling=sampling)
        for k in range(args.episodes)
    ]

    def batched():
        return runner.run(samples)

    def one_at_a_time():
        return [record for sample in samples for record in runner.run([sample])]

    sides = {"batched": batched, "one at a time": one_at_a_time}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    turns: dict[str, int] = {}
    for name, run in sides.items():  # warm-up, and the check that both sides run the same episodes
        records = run()
        turns[name] = sum(r.num_turns for r in records)
        tokens = [r.response_ids for r in records]
        if name == "batched":
            reference = tokens
        elif tokens != reference:
            raise SystemExit("the two sides generated different tokens")
    for _ in range(args.repeats):
        for name, run in sides.items():
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)

    rates = {}
    for name in sides:
        median = statistics.median(seconds[name])
        rates[name] = turns[name] / median
        print(
            f"{name:>14}: {turns[name]} turns of {args.episodes} episodes in {median:.3f} s: {rates[name]:.0f} turns/s"
        )
    print(f"episode_batching_speedup {rates['batched'] / rates['one at a time']:.2f}")


if __name__ == "__main__":
    main()
