"""Two trainer groups vs one: two adapters of the multi-LoRA loop on the embedded task, adapter steps per second.

Both sides run the plain multi-LoRA loop (`miles.loop.run_multi_lora`) on the same config and seed: adapter `add`
(addition) and adapter `sub` (subtraction), --steps rollouts each, served by one engine. On one side both adapters
are in trainer group `main` and take turns on its worker; on the other each has a group of its own, so their
train_steps run at the same time. One torch thread per engine and per trainer worker (2 cores: the engine and the
two workers share them). Steps per second: the adapter rollouts trained, less one, over the wall time from the
first to the last iteration's end (actor start and model load excluded).

Also prints each side's mean phase times, the adapter push among them (`time_sync`: the adapter's PEFT tensors from
its trainer group to the engine through Ray's object store).

Prints `trainer_groups_speedup <adapter steps/s with two groups / with one>` (goal: >= 1.4).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from benchmarks.smoke import UNTRAINED_MODEL, parse_args
from miles.cluster.actors import ensure_ray
from miles.config import load_config
from miles.loop import run_multi_lora

ADAPTER = "{{name: {name}, data: {{task: {task}}}, num_steps: {steps}, rollout_batch_size: {prompts}, n_samples_per_prompt: {samples}, trainer_group: {group}, eval: {{datasets: []}}}}"


def _config(groups: tuple[str, str], args) -> object:
    adapters = ", ".join(
        ADAPTER.format(name=name, task=task, steps=args.steps, prompts=args.prompts, samples=args.samples, group=group)
        for (name, task), group in zip((("add", "addition"), ("sub", "subtraction")), groups, strict=True)
    )
    overrides = [f"adapters=[{adapters}]", "rollout.num_threads=1", "train.num_threads=1", *args.overrides]
    return load_config(None, overrides, run_dir=tempfile.mkdtemp(prefix="trainer-groups-"))


def _measure(groups: tuple[str, str], args) -> dict[str, float]:
    config = _config(groups, args)
    records = [r for rows in run_multi_lora(config).values() for r in rows]
    ends = sorted(r["finished_at"] for r in records)
    return {
        "passes": config.train.num_passes,
        "steps_per_s": (len(ends) - 1) / (ends[-1] - ends[0]),
        **{phase: statistics.mean(r[f"time_{phase}"] for r in records) for phase in ("generate", "train", "sync")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="rollouts per adapter")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per rollout")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    args = parse_args(parser, steps=2, prompts=2, samples=2, overrides=UNTRAINED_MODEL)
    ensure_ray(None, 4)
    sides = {"one group": _measure(("main", "main"), args), "two groups": _measure(("first", "second"), args)}

    print(
        f"embedded model, adapters add and sub (rank 8): {args.steps} rollouts each of {args.prompts} prompts x "
        f"{args.samples} samples, {sides['one group']['passes']} optimizer step(s) per rollout (train.num_passes); "
        "one engine"
    )
    print(f"{'side':<12}{'steps/s':>9}{'generate s':>12}{'train s':>9}{'push s':>8}")
    for side, m in sides.items():
        print(f"{side:<12}{m['steps_per_s']:>9.3f}{m['generate']:>12.3f}{m['train']:>9.3f}{m['sync']:>8.3f}")
    print(f"trainer_groups_speedup {sides['two groups']['steps_per_s'] / sides['one group']['steps_per_s']:.3f}")


if __name__ == "__main__":
    main()
