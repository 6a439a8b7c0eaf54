"""What the SGLang engine's HTTP path costs: the TorchEngine in this process vs SGLangEngine driving a server.

Without a GPU there is no SGLang to run, so the server is the tests' stand-in (tests/miles/engines/sglang_server.py),
which generates with the same TorchEngine. Both sides use one torch thread, the same random Llama (the model of
engine_throughput.py) and the same seeded requests, and must return identical tokens; the difference in time is
the client's and the protocol's: JSON bodies of token ids and log-probs, HTTP, and the server's request handling
(the stand-in is FastAPI with the standard json module; SGLang encodes with orjson). The weight push is timed too:
`update_weights` in memory vs safetensors on disk + the refit session + the server's load.

Run it from the repository root (the server is started as `python -m tests.miles.engines.sglang_server`). Each
side is warmed up once, then `--repeats` timed runs alternate; medians are reported.
Last line: `client_overhead <SGLangEngine seconds / TorchEngine seconds per generate>`.
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
from benchmarks.smoke import parse_args
from miles.config import SGLangConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.sglang_engine import SGLangEngine
from miles.engines.torch_engine import TorchEngine

STAND_IN = "tests.miles.engines.sglang_server"


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
    args = parse_args(parser, hidden=64, layers=1, vocab=256, batch=2, prompt_tokens=4, new_tokens=2, repeats=1)
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="sglang-client-") as workdir:
        model_dir = Path(workdir) / "model"
        model = random_llama(model_dir, args.hidden, args.layers, args.vocab, args.prompt_tokens + args.new_tokens + 8)
        print(
            f"random Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; batch {args.batch} x "
            f"({args.prompt_tokens} prompt + {args.new_tokens} new tokens), 1 torch thread per side"
        )
        generator = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, args.vocab, (args.batch, args.prompt_tokens), generator=generator).tolist()
        sampling = SamplingParams(max_new_tokens=args.new_tokens)
        requests = [GenerateRequest(prompt_ids=p, sampling=sampling, seed=i) for i, p in enumerate(prompts)]

        local = TorchEngine(str(model_dir), num_threads=1)
        started = time.perf_counter()
        remote = SGLangEngine(str(model_dir), device="cpu", config=SGLangConfig(server_module=STAND_IN))
        print(f"server start (stand-in): {time.perf_counter() - started:.1f} s")
        try:
            sides = {"in process": local.generate, "over HTTP": remote.generate}
            outputs = {name: generate(requests) for name, generate in sides.items()}  # warm-up
            if [r.output_ids for r in outputs["in process"]] != [r.output_ids for r in outputs["over HTTP"]]:
                raise SystemExit("the two sides sampled different tokens")
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
    tokens = args.batch * args.new_tokens
    print(f"{'side':<14}{'tokens/s':>10}{'s/generate':>12}  {'runs (s)':<24}{'weight push (s)':>16}")
    for name in sides:
        median = statistics.median(times[name])
        print(
            f"{name:<14}{tokens / median:>10.0f}{median:>12.3f}  {', '.join(f'{t:.3f}' for t in times[name]):<24}{push[name]:>16.3f}"
        )
    print(f"weight push of {megabytes:.0f} MiB: {push['over HTTP'] / push['in process']:.1f}x the in-memory load")
    print(f"client_overhead {statistics.median(times['over HTTP']) / statistics.median(times['in process']):.3f}")


if __name__ == "__main__":
    main()
