"""Trainer scaling: the trainer group with 1 worker (unsharded) vs 2 workers (FSDP2 over gloo) on the same batch.

Each side starts the trainer group as a run does (`start_trainer_group`: Ray actors in a placement group, one torch
thread each), in a run directory of its own, on the same model directory and the same rollout table. One
warm-up `train` call, then --steps timed calls, each with a new rollout_id and exactly one optimizer step (the
global batch is the whole table); the group is killed before the next side starts. With 2 workers each rank
trains its half of every global batch and FSDP2 gathers the layers' parameters and sums their gradients.

The model is a randomly initialised Llama (--hidden, --layers, --vocab; about 21M parameters by default). The
rollout table has the real schema, built from random tokens: --batch rows of --prompt-tokens prompt and
--response-tokens response tokens (all trained), rollout log-probs those of the initial model.

Memory per rank is a static count, taken in each worker after the timed steps: the bytes of its local
parameters, gradients (a step's `zero_grad(set_to_none=True)` runs at its start, so they are still there) and
optimizer state tensors; a DTensor counts its local shard. These three do not change after the first step, so
the count is also their peak; activations and FSDP2's gathered copies of a layer are transient and not in it.
The figure is the largest over the ranks.

s/step: median wall seconds of one timed `train` call, as the driver sees it; tokens/s: trained response
tokens per wall second.

Prints `dp_speedup <seconds per step with 1 worker / with 2>` (goal: >= 1.7 on 2 cores) and, last,
`shard_memory_ratio <param+grad+optim bytes per rank with 2 workers / with 1>` (goal: <= 0.6).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch
from torch.distributed.tensor import DTensor
from transformers.utils import logging as hf_logging

from benchmarks.random_llama import random_llama
from benchmarks.smoke import parse_args
from benchmarks.train_step import rollout_table
from miles.cluster.actors import ensure_ray
from miles.config import load_config
from miles.state.run_dir import RunDir
from miles.train.actor import TrainActor
from miles.train.group import start_trainer_group

WORKER_COUNTS = (1, 2)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _training_state_bytes(actor) -> int:
    """Run inside a TrainActor: its resident parameters, gradients and optimizer state, in bytes."""
    parameters = list(actor.model.parameters())
    return (
        sum(_local_bytes(p) for p in parameters)
        + sum(_local_bytes(p.grad) for p in parameters if p.grad is not None)
        + sum(
            _local_bytes(value)
            for state in actor.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
    )


def _measure(workers: int, model_dir: Path, run_dir: Path, table_ref: ray.ObjectRef, args) -> tuple[list[float], int]:
    """Seconds of each timed train call and the largest param+grad+optim bytes of a rank, with `workers` workers."""
    RunDir(run_dir).create()
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            f"train.num_workers={workers}",
            "train.num_threads=1",
            f"train.global_batch_size={args.batch}",
            f"train.micro_batch_size={args.micro_batch}",
            "train.num_passes=1",
            f"rollout.rollout_batch_size={args.batch}",
            "rollout.n_samples_per_prompt=1",
            f"rollout.max_new_tokens={args.response_tokens}",
        ],
        run_dir=str(run_dir),
    )
    group = start_trainer_group(config, model_dir, None)
    try:
        group.call(TrainActor.train, 0, table_ref)  # warm-up: FSDP2's lazy init, the optimizer state's allocation
        times = []
        for rollout_id in range(1, args.steps + 1):
            started = time.perf_counter()
            group.call(TrainActor.train, rollout_id, table_ref)
            times.append(time.perf_counter() - started)
        state_bytes = max(ray.get([handle.__ray_call__.remote(_training_state_bytes) for handle in group.handles]))
    finally:
        group.kill()
    return times, state_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64, help="rows of the rollout: the global batch of one step")
    parser.add_argument("--micro-batch", type=int, default=16, help="samples per forward/backward on a worker")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--response-tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=3, help="timed train calls per side, after one warm-up")
    args = parse_args(
        parser, hidden=64, layers=1, vocab=256, batch=4, micro_batch=2, prompt_tokens=4, response_tokens=4, steps=1
    )
    hf_logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="trainer-scaling-") as workdir:
        model_dir = Path(workdir) / "model"
        positions = max(256, args.prompt_tokens + args.response_tokens)
        model = random_llama(model_dir, args.hidden, args.layers, args.vocab, positions)
        parameters = sum(p.numel() for p in model.parameters())
        table = rollout_table(model_dir, args.batch, args.prompt_tokens, args.response_tokens, args.micro_batch)
        ensure_ray(None, max(WORKER_COUNTS))
        table_ref = ray.put(table)
        results = {
            workers: _measure(workers, model_dir, Path(workdir) / f"run-{workers}", table_ref, args)
            for workers in WORKER_COUNTS
        }

    trained_tokens = args.batch * args.response_tokens
    print(
        f"model: random Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
        f"{parameters / 1e6:.2f}M parameters, fp32; one torch thread per worker"
    )
    print(
        f"rollout: {args.batch} samples x ({args.prompt_tokens} prompt + {args.response_tokens} response) tokens; "
        f"one optimizer step per call (global batch {args.batch}), micro-batch {args.micro_batch}"
    )
    print(f"{'workers':<9}{'s/step':>10}{'tokens/s':>12}{'MiB/rank':>11}   calls (s)")
    seconds = {}
    for workers, (times, state_bytes) in results.items():
        seconds[workers] = statistics.median(times)
        print(
            f"{workers:<9}{seconds[workers]:>10.3f}{trained_tokens / seconds[workers]:>12.0f}"
            f"{state_bytes / 2**20:>11.1f}   {', '.join(f'{t:.3f}' for t in times)}"
        )
    print("(MiB/rank: parameters + gradients + optimizer state resident on the largest rank)")
    print(f"dp_speedup {seconds[1] / seconds[2]:.3f}")
    print(f"shard_memory_ratio {results[2][1] / results[1][1]:.3f}")


if __name__ == "__main__":
    main()
