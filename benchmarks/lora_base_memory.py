"""LoRA trainer memory per worker: a bf16 base sharded over 2 workers vs a float32 base on 1 unsharded worker.

Both sides start a LoRA trainer group as the multi-LoRA run does (`start_worker_group` of LoRATrainActors, one torch
thread each) with the same --adapters adapters (rank --rank on every linear layer of the decoder) and train each of
them once on the same rollout table. The base is a randomly initialised Llama (--hidden, --layers, --vocab), saved
once in float32 (the side of one worker, as the multi-LoRA trainer held every base before) and once in bfloat16 (the
side of two FSDP2 workers: the base in its dtype, each worker a half of it).

Memory per worker is what it holds in tensors (tests.helpers.lora_memory) after the training: the worker's part of
the frozen base, the adapters' parameters and gradients, their optimizer state; the largest over the ranks. These
stay as they are after the first step. Activations and FSDP2's gathered copy of a layer are transient and not in it; the peak RSS of each
worker process (which also holds torch, Ray's worker and a whole base while loading it) is printed beside.

Prints `lora_base_memory_ratio <bytes per worker with a bf16 base on 2 workers / with a float32 base on 1>` (goal:
<= 0.3).
"""

from __future__ import annotations

import argparse
import resource
import tempfile
from pathlib import Path

import ray
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from benchmarks.random_llama import random_llama
from benchmarks.smoke import parse_args
from benchmarks.train_step import rollout_table
from miles.cluster.actors import ensure_ray
from miles.config import AdapterConfig, load_config
from miles.models.tiny import build_tokenizer
from miles.state.run_dir import RunDir
from miles.train.group import start_worker_group
from miles.train.lora import LoRATrainActor
from tests.helpers.lora_memory import each_worker_held_bytes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peak_rss_mib(_actor) -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _measure(model_dir: Path, workers: int, run_dir: Path, table_ref: ray.ObjectRef, args) -> tuple[dict, float]:
    """The largest held_bytes of a worker (by total) and the largest peak RSS in MiB, with `workers` workers."""
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            f"train.num_workers={workers}",
            f"train.sharding={'fsdp' if workers > 1 else 'none'}",
            "train.num_threads=1",
            f"train.global_batch_size={args.batch}",
            f"train.micro_batch_size={args.micro_batch}",
            f"rollout.rollout_batch_size={args.batch}",
            "rollout.n_samples_per_prompt=1",
            f"rollout.max_new_tokens={args.response_tokens}",
        ],
        run_dir=str(run_dir),
    )
    group = start_worker_group(config, LoRATrainActor, str(model_dir))
    try:
        for index in range(args.adapters):
            name = f"tenant-{index}"
            view = config.model_copy(update={"run_dir": str(RunDir(run_dir).adapter(name).create().path)})
            adapter = AdapterConfig(name=name, rank=args.rank, target_modules=TARGETS)
            group.call(LoRATrainActor.add_adapter, adapter, view, None)
            group.call(LoRATrainActor.train, name, 0, table_ref)
        held = each_worker_held_bytes(group)
        rss = ray.get([handle.__ray_call__.remote(_peak_rss_mib) for handle in group.handles])
    finally:
        group.kill()
    return max(held, key=lambda h: sum(h.values())), max(rss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--adapters", type=int, default=2, help="adapters on the base, each trained once")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="rows of the rollout: one optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--response-tokens", type=int, default=32)
    args = parse_args(
        parser, hidden=64, layers=1, vocab=256, batch=4, micro_batch=2, prompt_tokens=4, response_tokens=4, adapters=1
    )
    hf_logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="lora-base-memory-") as workdir:
        fp32_dir, bf16_dir = Path(workdir) / "fp32", Path(workdir) / "bf16"
        positions = max(256, args.prompt_tokens + args.response_tokens)
        model = random_llama(fp32_dir, args.hidden, args.layers, args.vocab, positions)
        parameters = sum(p.numel() for p in model.parameters())
        del model
        AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=torch.bfloat16).save_pretrained(bf16_dir)
        build_tokenizer().save_pretrained(bf16_dir)
        table = rollout_table(fp32_dir, args.batch, args.prompt_tokens, args.response_tokens, args.micro_batch)
        ensure_ray(None, 2)
        table_ref = ray.put(table)
        sides = {
            "fp32 base, 1 worker": _measure(fp32_dir, 1, Path(workdir) / "run-fp32", table_ref, args),
            "bf16 base, 2 workers (FSDP2)": _measure(bf16_dir, 2, Path(workdir) / "run-bf16", table_ref, args),
        }

    print(
        f"base: random Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
        f"{parameters / 1e6:.1f}M parameters; {args.adapters} adapters of rank {args.rank} on {len(TARGETS)} "
        f"modules per layer, each trained on {args.batch} x ({args.prompt_tokens} + {args.response_tokens}) tokens"
    )
    print(f"{'side':<30}{'base MiB':>10}{'adapters MiB':>14}{'optimizer MiB':>15}{'total MiB':>11}{'peak RSS MiB':>14}")
    totals = {}
    for side, (held, rss) in sides.items():
        totals[side] = sum(held.values())
        mib = {key: value / 2**20 for key, value in held.items()}
        print(
            f"{side:<30}{mib['base']:>10.1f}{mib['adapters']:>14.2f}{mib['optimizer']:>15.2f}"
            f"{totals[side] / 2**20:>11.1f}{rss:>14.0f}"
        )
    print("(per worker, the largest rank; adapters: parameters and gradients, float32 on both sides)")
    fp32, bf16 = totals.values()
    print(f"lora_base_memory_ratio {bf16 / fp32:.3f}")


if __name__ == "__main__":
    main()
