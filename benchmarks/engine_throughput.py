"""Generation throughput: TorchEngine.generate vs Hugging Face `model.generate` on the same model directory.

Both sides load the same directory in fp32 on the CPU, run in this process with the same torch thread count,
and sample the same batch of prompts (all of one length, so no padding) at temperature 1.0, top-p 1.0, with
every sequence running the full `--new-tokens`: the engine gets no stop tokens, and Hugging Face gets no
eos token (so no stopping criterion on it), top-k off, and `min_new_tokens = max_new_tokens`. The engine
returns the log-prob of each sampled token, so the Hugging Face side returns its per-step scores and its
time includes the log_softmax + gather that turns them into the same per-token log-probs. Hugging Face
runs under torch.inference_mode, as the engine does.

Each side is warmed up once, then `--repeats` timed runs alternate (engine, HF, engine, HF, ...);
tokens/s = batch * new tokens / median wall seconds of a run. The mean log-prob of the sampled tokens is
shown per side as a check that both sample from the same distribution (at the default sizes the two agree
to within about 0.01; small batches vary more).

The default model is a randomly initialised Llama (see --hidden/--layers/--heads) with a real LLM's vocabulary
size (32000, `--vocab`); `--embedded` uses the embedded tiny model instead (built once and cached), whose
vocabulary is 16 tokens and whose context is 32 positions: longer runs go past it (RoPE has no hard limit, so
the cost per token is what it would be; Hugging Face prints a reminder).

Last line: `engine_speedup <engine tokens/s / Hugging Face tokens/s>` (goal: >= 2).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.utils import logging as hf_logging

from benchmarks.random_llama import random_llama
from benchmarks.smoke import parse_args
from miles.config import ModelConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models import ensure_embedded_model


def _run_engine(engine: TorchEngine, requests: list[GenerateRequest]) -> tuple[float, torch.Tensor, torch.Tensor]:
    started = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - started
    return seconds, torch.tensor([r.output_ids for r in results]), torch.tensor([r.logprobs for r in results])


def _run_hf(
    model, prompts: torch.Tensor, generation: GenerationConfig, seed: int
) -> tuple[float, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=generation)
        tokens = out.sequences[:, prompts.shape[1] :]
        scores = torch.stack(out.scores, dim=1)  # (batch, new tokens, vocab), temperature-scaled logits
        logprobs = scores.float().log_softmax(dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    seconds = time.perf_counter() - started
    return seconds, tokens, logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256, help="random model: hidden size")
    parser.add_argument("--layers", type=int, default=4, help="random model: decoder layers")
    parser.add_argument("--heads", type=int, default=4, help="random model: attention heads")
    parser.add_argument(
        "--vocab", type=int, default=32000, help="random model: vocabulary size (default: a Llama-2-sized one)"
    )
    parser.add_argument("--embedded", action="store_true", help="use the embedded tiny model instead of a random Llama")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (median)")
    parser.add_argument("--threads", type=int, default=2)
    args = parse_args(
        parser, hidden=64, layers=1, heads=1, vocab=256, batch=2, prompt_tokens=4, new_tokens=4, repeats=1, threads=1
    )
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="engine-throughput-") as workdir:
        if args.embedded:
            model_dir = ensure_embedded_model(ModelConfig(), ["addition"], seed=0)
        else:
            model_dir = Path(workdir) / "model"
            random_llama(
                model_dir,
                args.hidden,
                args.layers,
                args.vocab,
                max(256, args.prompt_tokens + args.new_tokens),
                args.heads,
            )
        engine = TorchEngine(str(model_dir), num_threads=args.threads)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # no eos stopping: every row runs max_new_tokens
        pad = hf.config.pad_token_id or 0
        parameters = sum(p.numel() for p in hf.parameters())
        shape = hf.config
        print(
            f"model: {'embedded' if args.embedded else 'random'} Llama hidden {shape.hidden_size}, {shape.num_hidden_layers} layers, "
            f"{shape.num_attention_heads} heads, vocab {shape.vocab_size}: {parameters / 1e6:.2f}M parameters"
        )
        print(
            f"batch {args.batch} x ({args.prompt_tokens} prompt + {args.new_tokens} new tokens), {torch.get_num_threads()} threads, "
            f"{args.repeats} timed runs per side"
        )

        generator = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, shape.vocab_size, (args.batch, args.prompt_tokens), generator=generator)
        sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens, stop_token_ids=())
        requests = [
            GenerateRequest(prompt_ids=row, sampling=sampling, seed=i) for i, row in enumerate(prompts.tolist())
        ]
        generation = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            pad_token_id=pad,
            eos_token_id=None,
            return_dict_in_generate=True,
            output_scores=True,
        )

        _run_engine(engine, requests)
        _run_hf(hf, prompts, generation, seed=0)
        times: dict[str, list[float]] = {"engine": [], "hf": []}
        mean_logprob: dict[str, list[float]] = {"engine": [], "hf": []}
        expected = (args.batch, args.new_tokens)
        for repeat in range(args.repeats):
            for side in ("engine", "hf"):
                if side == "engine":
                    seconds, tokens, logprobs = _run_engine(engine, requests)
                else:
                    seconds, tokens, logprobs = _run_hf(hf, prompts, generation, seed=repeat + 1)
                if tuple(tokens.shape) != expected or tuple(logprobs.shape) != expected:
                    raise SystemExit(
                        f"{side}: got tokens {tuple(tokens.shape)}, log-probs {tuple(logprobs.shape)}; expected {expected}"
                    )
                times[side].append(seconds)
                mean_logprob[side].append(float(logprobs.mean()))

    tokens_per_run = args.batch * args.new_tokens
    rate = {side: tokens_per_run / statistics.median(t) for side, t in times.items()}
    print(f"{'side':<24}{'tokens/s':>10}{'s/run':>9}  {'runs (s)':<26}{'mean log-prob':>14}")
    for side, label in (("engine", "TorchEngine.generate"), ("hf", "HF model.generate")):
        runs = ", ".join(f"{t:.3f}" for t in times[side])
        print(
            f"{label:<24}{rate[side]:>10.0f}{statistics.median(times[side]):>9.3f}  {runs:<26}"
            f"{statistics.mean(mean_logprob[side]):>14.3f}"
        )
    print(f"engine_speedup {rate['engine'] / rate['hf']:.2f}")


if __name__ == "__main__":
    main()
