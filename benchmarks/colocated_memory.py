"""Peak memory of a colocated engine and trainer: the engine releasing its memory for each train step vs keeping it.

Each side runs in a fresh child process holding a TorchEngine and a TrainActor on one device, as a colocated pair
shares a GPU, for --iterations iterations of the sync flow: generate a batch, train a step on a rollout table, push
the trainer's weights to the engine (the object-store transport's call, in process). With release, the engine
releases its KV cache and weights before the train step (`release_memory`), and takes the weights' memory back for
the push and the KV cache after it (`resume_memory`), as the InferenceController does. Memory is, on a CPU, the
child's peak RSS less its RSS after the imports, and on a GPU (--device cuda) the peak of CUDA's allocator.

What release can save: the engine's weights (and on a GPU its KV cache) while the trainer steps. The trainer keeps
its states (fp32 weights, gradients, AdamW's moments: 16 bytes a parameter) while the engine generates, so the peak
is at best the larger of the two phases.

The model is a randomly initialised Llama (--hidden, --layers, --vocab); the rollout table has the real schema, from
random tokens (benchmarks.train_step.rollout_table).

Last line: `colocated_memory_ratio <peak with release / peak without>` (goal: <= 0.7).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.multi_lora_memory import rss_mib
from benchmarks.smoke import parse_args


def _child(model_dir: str, release: bool, args: argparse.Namespace) -> None:
    import torch

    from benchmarks.train_step import rollout_table
    from miles.config import load_config
    from miles.engines.base import KV_CACHE, MEMORY_TAGS, WEIGHTS, GenerateRequest, SamplingParams
    from miles.engines.torch_engine import TorchEngine
    from miles.train.actor import TrainActor

    table = rollout_table(Path(model_dir), args.samples, args.prompt_tokens, args.new_tokens, args.samples)
    run_dir = Path(model_dir).parent / ("run-release" if release else "run-keep")
    run_dir.mkdir()
    config = load_config(
        None,
        [f"model.path={model_dir}", f"train.device={args.device}", f"train.global_batch_size={args.samples}",
         f"train.micro_batch_size={args.samples}", f"rollout.rollout_batch_size={args.samples}",
         "rollout.n_samples_per_prompt=1", f"train.num_threads={args.threads}"],
        run_dir=str(run_dir),
    )  # fmt: skip
    cuda = args.device.startswith("cuda")
    baseline = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mib()
    engine = TorchEngine(model_dir, device=args.device, num_threads=args.threads)
    trainer = TrainActor(config, model_dir)
    sampling = SamplingParams(max_new_tokens=args.new_tokens)  # no stop tokens: every row runs the full length
    prompt = list(range(3, 3 + args.prompt_tokens))
    requests = [GenerateRequest(prompt_ids=prompt, sampling=sampling, seed=i) for i in range(args.samples)]
    for rollout_id in range(args.iterations):
        engine.generate(requests)
        if release:
            engine.release_memory(MEMORY_TAGS)
        trainer.train(rollout_id, table)
        if release:
            engine.resume_memory([WEIGHTS])
        engine.update_weights(trainer.weights(), rollout_id + 1)
        if release:
            engine.resume_memory([KV_CACHE])
    peak = (
        torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    parameters = sum(p.numel() for p in engine.model.parameters())
    engine.shutdown()
    print(json.dumps({"memory_mib": peak - baseline, "parameters": parameters}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--samples", type=int, default=16, help="requests generated and trained on per iteration")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU's allocator peak")
    parser.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "SIDE"), help=argparse.SUPPRESS)
    args = parse_args(parser, hidden=64, layers=1, vocab=256, samples=2, prompt_tokens=4, new_tokens=4, iterations=1,
                      threads=1)  # fmt: skip
    if args.child:
        _child(args.child[0], args.child[1] == "release", args)
        return

    from benchmarks.random_llama import random_llama

    with tempfile.TemporaryDirectory(prefix="colocated-memory-") as workdir:
        model_dir = Path(workdir) / "model"
        random_llama(model_dir, args.hidden, args.layers, args.vocab, positions=args.prompt_tokens + args.new_tokens)
        runs = {}
        for side in ("keep", "release"):
            command = [sys.executable, "-m", "benchmarks.colocated_memory", "--child", str(model_dir), side]
            for name in ("samples", "prompt_tokens", "new_tokens", "iterations", "threads", "device"):
                command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs[side] = json.loads(out.strip().splitlines()[-1])
    parameters = runs["keep"]["parameters"]
    print(
        f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {parameters / 1e6:.1f}M parameters "
        f"(fp32 {parameters * 4 / 2**20:.0f} MiB); {args.iterations} iterations of {args.samples} samples x "
        f"{args.new_tokens} new tokens on {args.device}"
    )
    print(f"{'engine':<40}{'peak MiB':>10}")
    print(f"{'keeps its memory':<40}{runs['keep']['memory_mib']:>10.0f}")
    print(f"{'releases it for each train step':<40}{runs['release']['memory_mib']:>10.0f}")
    print(f"colocated_memory_ratio {runs['release']['memory_mib'] / runs['keep']['memory_mib']:.3f}")


if __name__ == "__main__":
    main()
