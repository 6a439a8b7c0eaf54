"""Trainer throughput: token-budget micro-batches vs a fixed count of samples per micro-batch, on the same rollout.

Both sides are TrainActors built in this process (no Ray) on the same model directory and run `train` on the same
rollout table, one optimizer step per call (the global batch is the whole rollout). The budget side takes
`train.max_tokens_per_micro_batch` = --max-tokens: each micro-batch holds as many samples as fit in that many padded
tokens (samples x the longest of them). The count side takes `train.micro_batch_size` = the count a user would
choose for the same memory bound: as many of the longest sample as fit in --max-tokens (rounded down to a divisor of
the global batch, which the config requires), with the token limit set high enough never to bind. So neither side's
largest micro-batch goes past --max-tokens padded tokens. In both the trainer sorts each global batch longest first,
so micro-batches group samples of like lengths.

The rollout is long-tailed, as GRPO rollouts are: --samples rows with prompts of --prompt-tokens (a range) and
responses of --short-response tokens, but for --long-samples rows of --long-response tokens (ranges; random tokens,
lengths drawn uniformly, seeded); all response tokens trained, rollout log-probs those of the initial model. The
model is a randomly initialised Llama (--hidden, --layers, --vocab).

The warm-up call of each side starts from the same weights on the same table: the gradients after it (summed over
different micro-batches) must agree within float rounding, and the largest weight difference is shown. Then the
sides alternate, --repeats calls each, each with a new rollout_id. tokens/s = trained response tokens per call /
median wall seconds of a call.

Last line: `token_budget_speedup <budget tokens/s / count tokens/s>` (goal: >= 1.5).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch
from transformers.utils import logging as hf_logging

from benchmarks.random_llama import random_llama
from benchmarks.smoke import parse_args
from miles.config import RunConfig, load_config
from miles.engines.base import GenerateResult
from miles.rollout.generation import SampleRecord
from miles.rollout.schema import records_table
from miles.train.actor import TrainActor
from miles.train.logprobs import token_logprobs
from miles.train.update import prepare_batch, rank_micro_batches

# Largest gradient difference between the sides, relative to the largest gradient: float rounding of sums taken
# in a different grouping.
GRADIENT_TOLERANCE = 1e-4


def _uniform(low: int, high: int, count: int, generator: torch.Generator) -> list[int]:
    return torch.randint(low, high + 1, (count,), generator=generator).tolist()


@torch.no_grad()
def rollout_table(model, args) -> pa.Table:
    """--samples completions of random tokens with long-tailed response lengths, scored by `model`."""
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt_lengths = _uniform(*args.prompt_tokens, args.samples, generator)
    long_rows = set(torch.randperm(args.samples, generator=generator)[: args.long_samples].tolist())
    short_lengths = _uniform(*args.short_response, args.samples, generator)
    long_lengths = _uniform(*args.long_response, args.samples, generator)
    records = []
    for row, prompt_length in enumerate(prompt_lengths):
        response_length = long_lengths[row] if row in long_rows else short_lengths[row]
        tokens = torch.randint(3, vocab, (1, prompt_length + response_length), generator=generator)
        logprobs = token_logprobs(model(input_ids=tokens).logits, tokens)[0, prompt_length:]
        ids = tokens[0].tolist()
        result = GenerateResult(
            output_ids=ids[prompt_length:],
            logprobs=logprobs.tolist(),
            finish_reason="stop",
            weight_versions=[0] * response_length,
        )
        records.append(SampleRecord.completion(None, ids[:prompt_length], result, reward=0.0, finished=True))
    return records_table(
        records,
        rollout_id=0,
        first_index=0,
        group_index=[i // 8 for i in range(args.samples)],
        adapter=[None] * args.samples,
        label=[""] * args.samples,
        advantage=torch.randn(args.samples, generator=generator).tolist(),
    )


def _config(model_dir: Path, run_dir: Path, args, micro_batch_size: int, max_tokens: int) -> RunConfig:
    run_dir.mkdir(parents=True)
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            f"rollout.rollout_batch_size={args.samples}",
            "rollout.n_samples_per_prompt=1",
            "rollout.temperature=1.0",
            f"train.global_batch_size={args.samples}",
            f"train.micro_batch_size={micro_batch_size}",
            f"train.max_tokens_per_micro_batch={max_tokens}",
            "train.num_passes=1",
            f"train.num_threads={args.threads}",
        ],
        run_dir=str(run_dir),
    )


def _micro_batch_shape(table: pa.Table, config: RunConfig, pad_token_id: int) -> tuple[int, int, int]:
    """(micro-batches, padded tokens of the largest, padded tokens of all) of one optimizer step, as the trainer
    splits it."""
    batch, local_gbs = prepare_batch(table, config, pad_token_id)
    lengths = batch.lengths()
    padded = [
        (rows.stop - rows.start) * int(lengths[rows].max())
        for rows in rank_micro_batches(batch, slice(0, local_gbs), config)
    ]
    return len(padded), max(padded), sum(padded)


def _largest_difference(a: torch.nn.Module, b: torch.nn.Module, gradients: bool) -> float:
    """Largest absolute difference between the two models' gradients (or weights), parameter by parameter."""
    b_parameters = dict(b.named_parameters())
    differences = []
    for name, p in a.named_parameters():
        q = b_parameters[name]
        differences.append(float((p.grad - q.grad).abs().max() if gradients else (p - q).detach().abs().max()))
    return max(differences)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=48, help="rows of the rollout: the global batch of one step")
    parser.add_argument("--long-samples", type=int, default=4, help="rows with a long response")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"))
    parser.add_argument("--short-response", type=int, nargs=2, default=(20, 60), metavar=("MIN", "MAX"))
    parser.add_argument("--long-response", type=int, nargs=2, default=(400, 600), metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per micro-batch, at most")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3, help="timed train calls per side, after one warm-up")
    parser.add_argument("--threads", type=int, default=2)
    args = parse_args(
        parser,
        samples=4,
        long_samples=1,
        prompt_tokens=(2, 4),
        short_response=(2, 4),
        long_response=(8, 12),
        max_tokens=32,
        hidden=64,
        layers=1,
        vocab=256,
        repeats=1,
        threads=1,
    )
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="token-budget-") as workdir:
        model_dir = Path(workdir) / "model"
        longest_possible = args.prompt_tokens[1] + args.long_response[1]
        model = random_llama(model_dir, args.hidden, args.layers, args.vocab, max(256, longest_possible))
        parameters = sum(p.numel() for p in model.parameters())
        table = rollout_table(model, args)
        del model
        longest = max(
            len(prompt) + len(response)
            for prompt, response in zip(
                table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist(), strict=True
            )
        )
        fitting = args.max_tokens // longest
        if fitting < 1:
            parser.error(f"--max-tokens {args.max_tokens} holds no sample of the longest, {longest} tokens")
        count = max(size for size in range(1, fitting + 1) if args.samples % size == 0)
        configs = {
            "budget": _config(model_dir, Path(workdir) / "run-budget", args, args.samples, args.max_tokens),
            "count": _config(model_dir, Path(workdir) / "run-count", args, count, args.samples * longest),
        }
        actors = {side: TrainActor(config, str(model_dir)) for side, config in configs.items()}
        torch.set_num_threads(args.threads)
        shapes = {
            side: _micro_batch_shape(table, configs[side], actors[side].pad_token_id) for side in ("budget", "count")
        }
        trained_tokens = sum(len(mask) for mask in table.column("loss_mask").to_pylist())

        # Warm-up, from the same weights on the same table: both updates must agree.
        warm_up = {side: actor.train(0, table) for side, actor in actors.items()}
        gradient_scale = max(float(p.grad.abs().max()) for p in actors["count"].model.parameters())
        gradient_difference = _largest_difference(actors["budget"].model, actors["count"].model, gradients=True)
        weight_difference = _largest_difference(actors["budget"].model, actors["count"].model, gradients=False)

        times: dict[str, list[float]] = {"budget": [], "count": []}
        for rollout_id in range(1, args.repeats + 1):
            for side, actor in actors.items():
                started = time.perf_counter()
                actor.train(rollout_id, table)
                times[side].append(time.perf_counter() - started)

    print(
        f"model: random Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
        f"{parameters / 1e6:.2f}M parameters, fp32, {args.threads} threads"
    )
    print(
        f"rollout: {args.samples} samples, prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens, responses "
        f"{args.short_response[0]}-{args.short_response[1]} tokens but {args.long_samples} of "
        f"{args.long_response[0]}-{args.long_response[1]}; longest sample {longest} tokens, {trained_tokens} trained "
        "tokens; one optimizer step per call"
    )
    print(
        f"budget: {args.max_tokens} padded tokens per micro-batch; count: {count} samples per micro-batch "
        f"({args.max_tokens} // {longest} = {fitting}, a divisor of the global batch)"
    )
    print(
        f"warm-up loss: budget {warm_up['budget']['loss']:.6f}, count {warm_up['count']['loss']:.6f}; "
        f"max |gradient diff| after it: {gradient_difference:.3g} (max |gradient| {gradient_scale:.3g}); "
        f"max |weight diff|: {weight_difference:.3g}"
    )
    if gradient_difference > GRADIENT_TOLERANCE * gradient_scale:
        raise SystemExit(f"the two sides' gradients differ by {gradient_difference:.3g}, past float rounding")
    print(f"{'side':<8}{'micro-batches':>15}{'largest':>9}{'padded':>8}{'s/step':>9}{'tokens/s':>10}   calls (s)")
    seconds = {side: statistics.median(t) for side, t in times.items()}
    for side in ("budget", "count"):
        batches, largest, padded = shapes[side]
        print(
            f"{side:<8}{batches:>15}{largest:>9}{padded:>8}{seconds[side]:>9.3f}{trained_tokens / seconds[side]:>10.0f}   "
            f"{', '.join(f'{t:.3f}' for t in times[side])}"
        )
    print(
        "(largest, padded: padded tokens of the largest micro-batch and of all; s/step: median wall seconds of one "
        "train call; tokens/s: trained response tokens per wall second)"
    )
    print(f"token_budget_speedup {seconds['count'] / seconds['budget']:.3f}")


if __name__ == "__main__":
    main()
