"""Trainer memory: log-probs from the output head a chunk of positions at a time vs from the full-vocabulary logits.

The shape is one a user hit: SmolLM-135M's (a Llama of hidden 576, 30 layers, 9 heads, 3 key-value heads,
intermediate 1536, vocabulary 49152, tied embeddings; 134.5M parameters), randomly initialised (seeded) and saved
once, in fp32, under a temporary directory. The rollout table has the real schema, built from random tokens:
--samples rows of --prompt-tokens prompt and --response-tokens response tokens (all trained), rollout log-probs
those of the initial model; one micro-batch holds them all, as one optimizer step.

Each side runs in a fresh child process, so that its peak is its own: a TrainActor built in the process (no Ray)
with the settings a model on its own data gets (the own-data preset: activation checkpointing on) and
`train.logits_chunk_mb` = --chunk-mb (chunked) or 1e9 (one chunk: the full [B, T, V] logits, as before chunking),
then two `train` calls, `train_on_rollout` with the default algorithm; --set adds config overrides to both sides
(e.g. train.gradient_checkpointing=false). The first call makes AdamW's state; the second is measured, a step of a
run's steady state. Memory is the rise of the child's resident set during it: its peak (VmHWM, reset through
/proc/self/clear_refs just before the call) minus its RSS just before it. The children run with glibc's
MALLOC_MMAP_THRESHOLD_ at 1 MiB, so that a freed large block leaves the resident set at once and the first call's
freed memory does not hide the second's. The rise holds the gradients (the weights' size: 0.5 GiB at 134.5M
parameters) as well as the activations and the logits.

After the measurement each child loads the initial weights again and writes the trainer's log-probs of the table
(`batch_logprobs`, with its side's chunk size) to a safetensors file; the parent checks that the two sides' agree
within 1e-5 at every token.

Last line: `logprob_memory_ratio <chunked peak rise / full-vocabulary peak rise>` (goal: <= 0.3).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from benchmarks.random_llama import random_llama
from benchmarks.smoke import parse_args
from benchmarks.train_step import rollout_table
from miles.config import load_config
from miles.state.run_dir import RunDir
from miles.train.actor import TrainActor
from miles.train.batch import batch_from_table
from miles.train.update import batch_logprobs

# One chunk larger than any [B, T, V] logits: the full-vocabulary path.
FULL_VOCABULARY_CHUNK_MB = 1e9
LOGPROB_TOLERANCE = 1e-5


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> None:
    """VmHWM starts again from the current RSS (Linux: 5 written to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _child(model_dir: str, table_path: str, logprobs_path: str, args) -> None:
    with pa.ipc.open_file(table_path) as reader:
        table = reader.read_all()
    run_dir = Path(logprobs_path).with_suffix(".run")
    RunDir(run_dir).create()
    samples = table.num_rows
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            # a model on its own data: the preset a user of such a model gets (activation checkpointing on)
            "data.task=null",
            "data.path=prompts.jsonl",
            f"rollout.rollout_batch_size={samples}",
            "rollout.n_samples_per_prompt=1",
            "rollout.temperature=1.0",
            f"train.global_batch_size={samples}",
            f"train.micro_batch_size={samples}",
            f"train.max_tokens_per_micro_batch={samples * (args.prompt_tokens + args.response_tokens)}",
            f"train.logits_chunk_mb={args.chunk_mb}",
            f"train.num_threads={args.threads}",
            *args.overrides,
        ],
        run_dir=str(run_dir),
    )
    actor = TrainActor(config, model_dir)
    actor.train(0, table)  # a first step makes AdamW's state: the measured step is one of a run's steady state
    gc.collect()
    before = _status_mib("VmRSS")
    _reset_peak_rss()
    started = time.perf_counter()
    metrics = actor.train(1, table)
    seconds = time.perf_counter() - started
    peak = _status_mib("VmHWM")
    del actor
    gc.collect()

    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = batch_from_table(table, initial.config.pad_token_id or 0)
    save_file({"logprobs": batch_logprobs(initial, batch, config, torch.device("cpu"))}, logprobs_path)
    print(
        json.dumps(
            {
                "rise_mib": peak - before,
                "before_mib": before,
                "peak_mib": peak,
                "seconds": seconds,
                "loss": metrics["loss"],
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--samples", type=int, default=16, help="rows of the rollout: one micro-batch, one step")
    parser.add_argument("--prompt-tokens", type=int, default=50)
    parser.add_argument("--response-tokens", type=int, default=150)
    parser.add_argument("--chunk-mb", type=float, default=64.0, help="train.logits_chunk_mb of the chunked side")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    parser.add_argument("--child", nargs=3, metavar=("MODEL_DIR", "TABLE", "LOGPROBS"), help=argparse.SUPPRESS)
    args = parse_args(
        parser,
        hidden=64,
        layers=1,
        heads=1,
        kv_heads=1,
        intermediate=128,
        vocab=256,
        samples=2,
        prompt_tokens=4,
        response_tokens=4,
        chunk_mb=0.002,  # two positions of the 256-token vocabulary: several chunks even at this size
        threads=1,
    )
    hf_logging.disable_progress_bar()
    if args.child:
        _child(*args.child, args)
        return

    with tempfile.TemporaryDirectory(prefix="logprob-memory-") as workdir:
        model_dir = Path(workdir) / "model"
        model = random_llama(
            model_dir,
            args.hidden,
            args.layers,
            args.vocab,
            max(256, args.prompt_tokens + args.response_tokens),
            args.heads,
            args.kv_heads,
            args.intermediate,
            tie_embeddings=True,
        )
        parameters = sum(p.numel() for p in model.parameters())
        del model
        table = rollout_table(model_dir, args.samples, args.prompt_tokens, args.response_tokens, micro=4)
        table_path = Path(workdir) / "rollout.arrow"
        with pa.ipc.new_file(table_path, table.schema) as writer:
            writer.write_table(table)
        runs, logprobs = {}, {}
        for side, chunk_mb in (("chunked", args.chunk_mb), ("full", FULL_VOCABULARY_CHUNK_MB)):
            logprobs_path = Path(workdir) / f"{side}.safetensors"
            command = [
                sys.executable,
                "-m",
                "benchmarks.logprob_memory",
                "--child",
                str(model_dir),
                str(table_path),
                str(logprobs_path),
                *("--chunk-mb", str(chunk_mb), "--threads", str(args.threads)),
                *("--prompt-tokens", str(args.prompt_tokens), "--response-tokens", str(args.response_tokens)),
                *(f"--set={override}" for override in args.overrides),
            ]
            # glibc then returns a freed block of 1 MiB or more at once: the resident set follows what is in use, not
            # what the allocator keeps from the first step
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
            runs[side] = json.loads(out.strip().splitlines()[-1])
            logprobs[side] = load_file(str(logprobs_path))["logprobs"]

    logprob_diff = float((logprobs["chunked"] - logprobs["full"]).abs().max())
    chunked, full = runs["chunked"], runs["full"]
    logits_mib = args.samples * (args.prompt_tokens + args.response_tokens) * args.vocab * 4 / 2**20
    print(
        f"model: random Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), "
        f"intermediate {args.intermediate}, vocab {args.vocab}, tied embeddings: {parameters / 1e6:.1f}M parameters, "
        f"fp32, {args.threads} threads"
    )
    print(
        f"rollout: {args.samples} samples x ({args.prompt_tokens} prompt + {args.response_tokens} response) tokens, "
        f"one micro-batch, one optimizer step; its fp32 logits: {logits_mib:.0f} MiB"
        + "".join(f"; {override}" for override in args.overrides)
    )
    print(f"{'side':<10}{'chunk MiB':>12}{'RSS before':>12}{'peak':>10}{'rise':>10}{'s/step':>9}{'loss':>12}")
    for side, chunk_mb in (("chunked", args.chunk_mb), ("full", FULL_VOCABULARY_CHUNK_MB)):
        run = runs[side]
        print(
            f"{side:<10}{chunk_mb:>12g}{run['before_mib']:>12.0f}{run['peak_mib']:>10.0f}{run['rise_mib']:>10.0f}"
            f"{run['seconds']:>9.2f}{run['loss']:>12.6f}"
        )
    print("(MiB of resident memory: before the train call, its peak, the rise; s/step: wall seconds of the call)")
    saved = full["rise_mib"] - chunked["rise_mib"]
    print(f"chunking saves {saved:.0f} MiB: {saved / logits_mib:.1f}x the micro-batch's fp32 logits")
    print(f"max |log-prob difference| (batch_logprobs, initial weights): {logprob_diff:.3g}")
    if logprob_diff > LOGPROB_TOLERANCE:
        raise SystemExit(f"the two sides' log-probs differ by {logprob_diff:.3g} > {LOGPROB_TOLERANCE}")
    print(f"logprob_memory_ratio {chunked['rise_mib'] / full['rise_mib']:.3f}")


if __name__ == "__main__":
    main()
