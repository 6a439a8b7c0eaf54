"""Memory and speed of one TorchEngine serving 1 vs 4 LoRA adapters on one shared base model.

Each side runs in a fresh child process (so its peak RSS is its own): load the base, load the adapters,
then generate one batch whose requests are spread evenly over the adapters (each adapter's rows run
through its own LoRA weights in the same forward pass). Engine memory is the child's peak RSS minus its
RSS after the imports, i.e. the base weights, the adapters, the KV cache and the activations. For
contrast, the table also shows what 4 engines with one adapter each would hold: 4x the 1-adapter engine.

The base is a randomly initialised Llama larger than the embedded default (see --hidden/--layers), so
that weights, not the Python runtime, dominate: memory is about shapes, not about what the weights learned.

Last line: `memory_ratio <engine memory with 4 adapters / with 1>` (goal: <= 1.3).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.smoke import parse_args


def rss_mib() -> float:
    """This process's resident memory now, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _child(model_dir: str, adapters_dir: str, adapters: int, batch: int, new_tokens: int, threads: int) -> None:
    import torch
    from safetensors.torch import load_file

    from miles.engines.base import GenerateRequest, SamplingParams
    from miles.engines.torch_engine import TorchEngine

    after_imports = rss_mib()
    engine = TorchEngine(model_dir, num_threads=threads)
    config = json.loads((Path(adapters_dir) / "adapter_config.json").read_text())
    names = [f"adapter-{i}" for i in range(adapters)]
    for i, name in enumerate(names):
        engine.load_adapter(name, load_file(str(Path(adapters_dir) / f"{i}.safetensors")), config, version=1)
    sampling = SamplingParams(max_new_tokens=new_tokens)  # no stop tokens: every row runs the full length
    prompt = list(range(3, 35))
    requests = [
        GenerateRequest(prompt_ids=prompt, sampling=sampling, adapter=names[i % adapters], seed=i) for i in range(batch)
    ]
    engine.generate(requests[:adapters])  # warm-up: first-call allocations and kernel selection
    started = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.output_ids) for r in results)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "adapters": adapters,
                "engine_mib": peak - after_imports,
                "peak_rss_mib": peak,
                "tokens_per_s": tokens / seconds,
                "adapter_mib": sum(
                    t.numel() * t.element_size() for t in load_file(str(Path(adapters_dir) / "0.safetensors")).values()
                )
                / 2**20,
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


def _build(workdir: Path, hidden: int, layers: int, vocab: int, rank: int, count: int) -> tuple[Path, Path, int]:
    import torch
    from peft import get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file

    from benchmarks.random_llama import random_llama
    from miles.config import AdapterConfig
    from miles.train.lora import config_dict, lora_config

    model_dir, adapters_dir = workdir / "base", workdir / "adapters"
    model = random_llama(model_dir, hidden, layers, vocab, positions=256)
    lora = lora_config(AdapterConfig(name="bench", rank=rank, alpha=2 * rank))
    peft_model = get_peft_model(model, lora, adapter_name="bench")
    adapters_dir.mkdir()
    (adapters_dir / "adapter_config.json").write_text(json.dumps(config_dict(lora)))
    for i in range(count):
        weights = {
            k: torch.randn_like(v) * 0.01
            for k, v in get_peft_model_state_dict(peft_model, adapter_name="bench").items()
        }
        save_file(weights, str(adapters_dir / f"{i}.safetensors"))
    parameters = sum(p.numel() for p in model.parameters())
    return model_dir, adapters_dir, parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="requests in the measured batch")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "ADAPTERS_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--adapters", type=int, default=1, help=argparse.SUPPRESS)
    args = parse_args(parser, hidden=64, layers=1, vocab=256, rank=2, batch=4, new_tokens=2, threads=1)
    if args.child:
        _child(*args.child, args.adapters, args.batch, args.new_tokens, args.threads)
        return

    with tempfile.TemporaryDirectory(prefix="multi-lora-memory-") as workdir:
        model_dir, adapters_dir, parameters = _build(Path(workdir), args.hidden, args.layers, args.vocab, args.rank, 4)
        print(
            f"base: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {parameters / 1e6:.1f}M parameters "
            f"({parameters * 4 / 2**20:.0f} MiB fp32); LoRA rank {args.rank} on all linear layers; "
            f"batch {args.batch} x {args.new_tokens} new tokens"
        )
        runs = {}
        for adapters in (1, 4):
            command = [
                sys.executable,
                "-m",
                "benchmarks.multi_lora_memory",
                "--child",
                str(model_dir),
                str(adapters_dir),
                "--adapters",
                str(adapters),
                "--batch",
                str(args.batch),
                "--new-tokens",
                str(args.new_tokens),
                "--threads",
                str(args.threads),
            ]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs[adapters] = json.loads(out.strip().splitlines()[-1])
    one, four = runs[1], runs[4]
    print(f"adapter size: {one['adapter_mib']:.2f} MiB each")
    print(f"{'engine':<34}{'engine MiB':>12}{'peak RSS MiB':>14}{'tokens/s':>11}")
    for label, run in (("1 adapter", one), ("4 adapters, one engine", four)):
        print(f"{label:<34}{run['engine_mib']:>12.0f}{run['peak_rss_mib']:>14.0f}{run['tokens_per_s']:>11.0f}")
    print(f"{'4 engines, one adapter each':<34}{4 * one['engine_mib']:>12.0f}{4 * one['peak_rss_mib']:>14.0f}{'':>11}")
    print(f"tokens/s, 4 adapters vs 1: {four['tokens_per_s'] / one['tokens_per_s']:.2f}")
    print(f"memory_ratio {four['engine_mib'] / one['engine_mib']:.3f}")


if __name__ == "__main__":
    main()
