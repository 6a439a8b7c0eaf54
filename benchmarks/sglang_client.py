"""What the SGLang engine's HTTP path costs: the TorchEngine in this process vs SGLangEngine driving a server.

The server is the real SGLang 0.5.23 on this CPU where its environment is at hand (MILES_SGLANG_PYTHON or --python;
`make install-sglang-cpu`), else the tests' stand-in, which generates with the same TorchEngine. Both sides use one
torch thread, the same random Llama (the model of engine_throughput.py) and the same greedy requests; each side's
tokens/s counts the tokens it returned. Against the stand-in the difference is the client's and the protocol's (JSON
bodies of token ids and log-probs, HTTP, the server's request handling); against the real server it is also SGLang's
scheduler and its CPU kernels (torch_native attention) against ours. The weight push is timed too: `update_weights`
in memory vs safetensors on disk + the refit session + the server's load.

Run it from the repository root. Each side is warmed up once, then `--repeats` timed runs alternate; medians are
reported. Last line: `client_overhead <SGLangEngine seconds per token / TorchEngine seconds per token>`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.random_llama import random_llama
from benchmarks.sglang_servers import add_server_arguments, server_config
from benchmarks.smoke import parse_args
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.sglang_engine import SGLangEngine
from miles.engines.torch_engine import TorchEngine


def _timed(call) -> tuple[float, object]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    add_server_arguments(parser)
    args = parse_args(parser, hidden=64, layers=1, vocab=256, batch=2, prompt_tokens=4, new_tokens=2, repeats=1)
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="sglang-client-") as workdir:
        model_dir = Path(workdir) / "model"
        # SGLang warms up on a 30-token prompt: a context of at least 64
        positions = max(64, args.prompt_tokens + args.new_tokens + 8)
        model = random_llama(model_dir, args.hidden, args.layers, args.vocab, positions)
        print(
            f"random Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; batch {args.batch} x "
            f"({args.prompt_tokens} prompt + {args.new_tokens} new tokens), 1 torch thread per side"
        )
        generator = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, args.vocab, (args.batch, args.prompt_tokens), generator=generator).tolist()
        sampling = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
        requests = [GenerateRequest(prompt_ids=p, sampling=sampling, seed=i) for i, p in enumerate(prompts)]

        local = TorchEngine(str(model_dir), num_threads=1)
        server_name, config = server_config(args)
        started = time.perf_counter()
        remote = SGLangEngine(str(model_dir), device="cpu", config=config)
        print(f"server start ({server_name}): {time.perf_counter() - started:.1f} s")
        try:
            sides = {"in process": local.generate, "over HTTP": remote.generate}
            outputs = {name: generate(requests) for name, generate in sides.items()}  # warm-up
            tokens = {name: sum(len(r.output_ids) for r in results) for name, results in outputs.items()}
            same = sum(a.output_ids == b.output_ids for a, b in zip(*outputs.values(), strict=True))
            print(f"greedy samples equal on both sides: {same} of {len(requests)}")
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(args.repeats):
                for name, generate in sides.items():
                    times[name].append(_timed(partial(generate, requests))[0])
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            pushed = Path(workdir) / "pushed"

            def push_from_disk() -> None:  # the disk transport: the trainer writes, the server loads
                model.save_pretrained(pushed)
                remote.update_weights_from_disk(str(pushed), 1)

            push = {
                "in process": _timed(lambda: local.update_weights(weights, 1))[0],
                "over HTTP": _timed(push_from_disk)[0],
            }
        finally:
            remote.shutdown()

    megabytes = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
    print(f"{'side':<14}{'tokens/s':>10}{'s/generate':>12}  {'runs (s)':<24}{'weight push (s)':>16}")
    per_token = {}
    for name in sides:
        median = statistics.median(times[name])
        per_token[name] = median / tokens[name]
        runs = ", ".join(f"{t:.3f}" for t in times[name])
        print(f"{name:<14}{tokens[name] / median:>10.0f}{median:>12.3f}  {runs:<24}{push[name]:>16.3f}")
    print(f"weight push of {megabytes:.0f} MiB: {push['over HTTP'] / push['in process']:.1f}x the in-memory load")
    print(f"client_overhead {per_token['over HTTP'] / per_token['in process']:.3f}")


if __name__ == "__main__":
    main()
