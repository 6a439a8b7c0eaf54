"""Training throughput: `TrainActor.train` vs a plain PyTorch PPO-clip loop on the same model and batch.

Ours is a TrainActor built in this process (no Ray), so only the training code is compared: each call runs
`train_on_rollout` (table -> padded tensors, micro-batched forward/backward, grad clip, AdamW, metrics). The
plain loop trains a fresh copy of the same model (loaded from the same directory, fp32, AdamW with the same
lr, betas and weight decay, the same micro-/global-batch split and grad clip) on the same padded tensors,
built once with `batch_from_table` outside the timing: forward, log_softmax + gather of the next-token
log-probs (temperature 1), ratio to the old log-probs, clipped surrogate summed over the response tokens and
divided by the response tokens of the optimizer step, backward, clip_grad_norm_, step. Nothing else.

Old policy (--old-logprobs):
  rollout    (default) both sides take the rollout's log-probs as the old policy, without TIS
             (`algo.use_rollout_logprobs=true`, `algo.use_tis=false`): the plain loop runs no extra forward.
  recompute  the default algorithm: the old policy is the trainer's before the call's first optimizer step
             (the first global batch's own forward, plus a no-grad forward over the other rows) with TIS
             weights exp(old - rollout) clamped to [tis_clip_low, tis_clip]; the plain loop does the same work.

The rollout table has the real schema, built from random tokens: --samples rows of --prompt-tokens prompt and
--response-tokens response tokens (all trained), advantages standard normal, rollout log-probs those of the
initial model (so the first call is on-policy). The model is a randomly initialised Llama (--hidden,
--layers, --vocab) or, with --embedded, the embedded tiny model.

The warm-up call of each side starts from the same weights on the same table: the largest parameter
difference after it checks that both sides compute the same update. Then the sides alternate, --repeats calls
each (ours gets a new rollout_id every call: `train` runs once per id). tokens/s = trained response tokens
per call / median seconds per call.

Last line: `train_overhead <ours seconds per call / plain seconds per call>` (goal: <= 1.1).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import pyarrow as pa
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

from benchmarks.random_llama import random_llama
from benchmarks.smoke import parse_args
from miles.config import ModelConfig, RunConfig, load_config
from miles.engines.base import GenerateResult
from miles.models.tiny import ensure_embedded_model
from miles.rollout.generation import SampleRecord
from miles.rollout.schema import records_table
from miles.train.actor import TrainActor
from miles.train.batch import TrainBatch, batch_from_table


def _load(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()


@torch.no_grad()
def _next_token_logprobs(model, batch: TrainBatch, micro: int) -> torch.Tensor:
    """[B, T] log-prob of tokens[:, t] at position t (0 at position 0), micro-batch by micro-batch."""
    parts = []
    for start in range(0, len(batch), micro):
        tokens = batch.tokens[start : start + micro]
        logits = model(input_ids=tokens, attention_mask=batch.attention_mask[start : start + micro]).logits
        picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        parts.append(torch.nn.functional.pad(picked, (1, 0)))
    return torch.cat(parts)


def rollout_table(model_dir: Path, samples: int, prompt_tokens: int, response_tokens: int, micro: int) -> pa.Table:
    generator = torch.Generator().manual_seed(1)
    vocab = LlamaConfig.from_pretrained(model_dir).vocab_size
    prompts = torch.randint(3, vocab, (samples, prompt_tokens), generator=generator)
    responses = torch.randint(3, vocab, (samples, response_tokens), generator=generator)
    advantages = torch.randn(samples, generator=generator)
    tokens = torch.cat([prompts, responses], dim=1)
    unscored = TrainBatch(
        tokens,
        torch.ones_like(tokens),
        torch.zeros_like(tokens, dtype=torch.bool),
        torch.zeros(tokens.shape),
        advantages,
    )
    logprobs = _next_token_logprobs(_load(model_dir), unscored, micro)[:, prompt_tokens:]
    # Each sample a completion as the engine returns it: ended at a stop token, every token of weight version 0.
    records = [
        SampleRecord.completion(
            None,
            prompt,
            GenerateResult(output_ids=ids, logprobs=lps, finish_reason="stop", weight_versions=[0] * response_tokens),
            reward=0.0,
            finished=True,
        )
        for prompt, ids, lps in zip(prompts.tolist(), responses.tolist(), logprobs.tolist(), strict=True)
    ]
    return records_table(
        records,
        rollout_id=0,
        first_index=0,
        group_index=[i // 8 for i in range(samples)],
        adapter=[None] * samples,
        label=[""] * samples,
        advantage=advantages.tolist(),
    )


class PlainTrainer:
    """The PPO-clip update written out in plain PyTorch."""

    def __init__(self, model_dir: Path, config: RunConfig, recompute: bool):
        self.model = _load(model_dir)
        train = config.train
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train.lr, betas=train.adam_betas, weight_decay=train.weight_decay
        )
        self.gbs, self.mbs, self.grad_clip = train.global_batch_size, train.micro_batch_size, train.grad_clip
        algo = config.algo
        self.eps_low, self.eps_high = algo.eps_clip, algo.eps_clip_high or algo.eps_clip
        self.tis_low, self.tis_high = algo.tis_clip_low, algo.tis_clip
        self.recompute = recompute

    def train(self, batch: TrainBatch) -> float:
        """One pass over the batch; returns the mean per-token loss."""
        tokens_all, attention_all = batch.tokens, batch.attention_mask
        mask_all = batch.response_mask[:, 1:].float()
        rollout_lp = batch.rollout_logprobs[:, 1:]
        advantages = batch.advantages[:, None]
        if self.recompute:
            old_lp = torch.empty_like(rollout_lp)
            rest = slice(self.gbs, None)
            old_lp[rest] = _next_token_logprobs(self.model, batch.rows(rest), self.mbs)[:, 1:]
        total = torch.zeros(())
        for start in range(0, len(batch), self.gbs):
            step_tokens = mask_all[start : start + self.gbs].sum().clamp(min=1)
            self.optimizer.zero_grad(set_to_none=True)
            for m in range(start, start + self.gbs, self.mbs):
                rows = slice(m, m + self.mbs)
                tokens = tokens_all[rows]
                logits = self.model(input_ids=tokens, attention_mask=attention_all[rows]).logits
                logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
                if self.recompute:
                    if start == 0:
                        old_lp[rows] = logp.detach()
                    old = old_lp[rows]
                else:
                    old = rollout_lp[rows]
                ratio = torch.exp(logp - old)
                per_token = torch.maximum(
                    -advantages[rows] * ratio, -advantages[rows] * ratio.clamp(1 - self.eps_low, 1 + self.eps_high)
                )
                if self.recompute:
                    per_token = per_token * torch.exp(old - rollout_lp[rows]).clamp(self.tis_low, self.tis_high)
                loss = (per_token * mask_all[rows]).sum()
                (loss / step_tokens).backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
        return float(total / mask_all.sum().clamp(min=1))


def _max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pb = dict(b.named_parameters())
    return max(float((p.detach() - pb[name].detach()).abs().max()) for name, p in a.named_parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256, help="rows of the rollout")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=128, help="samples per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=32, help="samples per forward/backward")
    parser.add_argument(
        "--old-logprobs",
        choices=("rollout", "recompute"),
        default="rollout",
        help="old policy: the rollout's log-probs, or the trainer's recomputed ones with TIS",
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192, help="vocab / hidden near that of common LLMs (~32)")
    parser.add_argument("--embedded", action="store_true", help="the embedded tiny model instead of a random Llama")
    parser.add_argument("--repeats", type=int, default=3, help="timed train calls per side, after one warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    args = parse_args(
        parser,
        samples=8,
        prompt_tokens=4,
        response_tokens=4,
        global_batch=4,
        micro_batch=2,
        hidden=64,
        layers=1,
        vocab=256,
        repeats=1,
        threads=1,
    )
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    recompute = args.old_logprobs == "recompute"

    with tempfile.TemporaryDirectory(prefix="train-step-") as workdir:
        if args.embedded:
            model_dir = ensure_embedded_model(ModelConfig(), ["addition"], seed=0)
        else:
            positions = max(256, args.prompt_tokens + args.response_tokens)
            model_dir = Path(workdir) / "model"
            random_llama(model_dir, args.hidden, args.layers, args.vocab, positions)
        algo = (
            ["algo.use_rollout_logprobs=false", "algo.use_tis=true"]
            if recompute
            else ["algo.use_rollout_logprobs=true", "algo.use_tis=false"]
        )
        config = load_config(
            None,
            [
                f"model.path={model_dir}",
                f"rollout.rollout_batch_size={args.samples}",
                "rollout.n_samples_per_prompt=1",
                "rollout.temperature=1.0",
                f"train.global_batch_size={args.global_batch}",
                f"train.micro_batch_size={args.micro_batch}",
                "train.num_passes=1",
                f"train.num_threads={args.threads}",
                *algo,
                *args.overrides,
            ],
            run_dir=str(Path(workdir) / "run"),
        )
        if (
            config.train.num_passes != 1
            or config.rollout.temperature != 1.0
            or config.algo.use_kl_loss
            or config.algo.entropy_coef
        ):
            parser.error("the plain loop runs one pass at temperature 1 without KL or entropy terms")
        if config.algo.use_rollout_logprobs == recompute or config.algo.use_tis != recompute:
            parser.error("choose the old policy with --old-logprobs, not with algo.use_rollout_logprobs / algo.use_tis")

        table = rollout_table(model_dir, args.samples, args.prompt_tokens, args.response_tokens, args.micro_batch)
        Path(config.run_dir).mkdir(parents=True, exist_ok=True)
        ours = TrainActor(config, str(model_dir))
        plain = PlainTrainer(Path(model_dir), config, recompute)
        torch.set_num_threads(args.threads)
        batch = batch_from_table(table, ours.pad_token_id)
        trained_tokens = int(batch.response_mask.sum())
        parameters = sum(p.numel() for p in ours.model.parameters())

        # Warm-up, from the same weights on the same table: both updates must agree.
        ours_metrics = ours.train(0, table)
        plain_loss = plain.train(batch)
        diff = _max_param_diff(ours.model, plain.model)

        ours_times, plain_times, ours_cpu, plain_cpu = [], [], [], []
        for rollout_id in range(1, args.repeats + 1):
            for call, times, cpu in (
                (partial(ours.train, rollout_id, table), ours_times, ours_cpu),
                (lambda: plain.train(batch), plain_times, plain_cpu),
            ):
                started, started_cpu = time.perf_counter(), time.process_time()
                call()
                times.append(time.perf_counter() - started)
                cpu.append(time.process_time() - started_cpu)

    shape = (
        "embedded tiny model"
        if args.embedded
        else f"random Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}"
    )
    ours_s, plain_s = statistics.median(ours_times), statistics.median(plain_times)
    print(f"model: {shape}: {parameters / 1e6:.2f}M parameters, fp32, {args.threads} threads")
    print(
        f"rollout: {args.samples} samples x ({args.prompt_tokens} prompt + {args.response_tokens} response) tokens; "
        f"global batch {config.train.global_batch_size}, micro-batch {config.train.micro_batch_size}; "
        f"old log-probs: {args.old_logprobs}"
    )
    print(
        f"warm-up loss: ours {ours_metrics['loss']:.6f}, plain {plain_loss:.6f}; max |param diff| after it: {diff:.3g}"
    )
    print(f"{'side':<8}{'s/step':>10}{'tokens/s':>12}{'CPU s/step':>12}   calls (s)")
    for label, seconds, times, cpu in (
        ("ours", ours_s, ours_times, ours_cpu),
        ("plain", plain_s, plain_times, plain_cpu),
    ):
        print(
            f"{label:<8}{seconds:>10.3f}{trained_tokens / seconds:>12.0f}{statistics.median(cpu):>12.3f}   "
            f"{', '.join(f'{t:.3f}' for t in times)}"
        )
    print(
        "(s/step: median wall seconds of one train call over the rollout; tokens/s: trained response tokens per "
        "wall second; CPU s/step: median process CPU seconds over all threads)"
    )
    print(f"CPU time ratio (ours / plain): {statistics.median(ours_cpu) / statistics.median(plain_cpu):.3f}")
    print(f"train_overhead {ours_s / plain_s:.3f}")


if __name__ == "__main__":
    main()
