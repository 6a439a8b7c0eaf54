"""One rollout's policy update (GRPO advantages, PPO-clip, TIS, optional KL and entropy): shared by the
full-model TrainActor and the LoRA trainer, which differ only in which parameters the optimizer holds."""

from __future__ import annotations

import time
from collections.abc import Callable

import pyarrow as pa
import torch

from miles.config import RunConfig
from miles.train.batch import TrainBatch, batch_from_table
from miles.train.loss import (
    k3_kl,
    masked_entropy,
    next_token_log_softmax,
    picked_logprobs,
    ppo_clip_loss,
    tis_weights,
    token_logprobs,
)

ReferenceLogprobs = Callable[[TrainBatch], torch.Tensor]


@torch.no_grad()
def batch_logprobs(model, batch: TrainBatch, config: RunConfig, device: torch.device) -> torch.Tensor:
    """Per-token log-probs of the batch's tokens under `model`, micro-batch by micro-batch."""
    step = config.train.micro_batch_size
    parts = []
    for start in range(0, len(batch), step):
        mb = batch.rows(slice(start, start + step))
        logits = model(input_ids=mb.tokens.to(device), attention_mask=mb.attention_mask.to(device)).logits
        parts.append(token_logprobs(logits, mb.tokens.to(device), config.rollout.temperature))
    return torch.cat(parts)


def train_on_rollout(
    model,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    table: pa.Table,
    config: RunConfig,
    device: torch.device,
    pad_token_id: int,
    reference: ReferenceLogprobs | None = None,
) -> dict[str, float]:
    """`num_passes` passes of samples / global_batch_size optimizer steps over the rollout; returns its metrics."""
    started = time.perf_counter()
    algo = config.algo
    batch = batch_from_table(table, pad_token_id)
    mask_all = batch.response_mask.to(device)
    rollout_lp = batch.rollout_logprobs.to(device)
    gbs, mbs = config.train.global_batch_size, config.train.micro_batch_size
    # The policy before this rollout's first step: the first global batch's forward passes run before that
    # step, so they give its rows for free. The other rows need a forward now, before any step, when the loss uses
    # them (as the old policy, or for TIS); otherwise the trainer-vs-rollout metrics cover the first batch only.
    trainer_lp = torch.zeros_like(rollout_lp)
    needs_old_policy = not algo.use_rollout_logprobs or algo.use_tis
    if len(batch) > gbs and needs_old_policy:
        trainer_lp[gbs:] = batch_logprobs(model, batch.rows(slice(gbs, None)), config, device)
    measured = slice(None) if needs_old_policy else slice(0, gbs)
    ref_lp = reference(batch) if reference is not None else None
    eps_high = algo.eps_clip_high if algo.eps_clip_high is not None else algo.eps_clip

    sums = dict(loss=0.0, pg_loss=0.0, kl_ref=0.0, entropy=0.0, ppo_kl=0.0, clipped=0.0, tokens=0.0)
    grad_norms = []
    for pass_ in range(config.train.num_passes):
        for start in range(0, len(batch), gbs):
            step_tokens = mask_all[start : start + gbs].sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            for m in range(start, start + gbs, mbs):
                rows = slice(m, m + mbs)
                mb = batch.rows(rows)
                tokens = mb.tokens.to(device)
                mask = mask_all[rows].float()
                logits = model(input_ids=tokens, attention_mask=mb.attention_mask.to(device)).logits
                log_softmax = next_token_log_softmax(logits, config.rollout.temperature)
                logp = picked_logprobs(log_softmax, tokens)
                if pass_ == 0 and start == 0:
                    trainer_lp[rows] = logp.detach()
                old_lp = rollout_lp[rows] if algo.use_rollout_logprobs else trainer_lp[rows]
                tis = (
                    tis_weights(trainer_lp[rows], rollout_lp[rows], algo.tis_clip_low, algo.tis_clip)
                    if algo.use_tis
                    else None
                )
                pg, clipped = ppo_clip_loss(
                    logp, old_lp, mb.advantages.to(device), mask, algo.eps_clip, eps_high, token_weights=tis
                )
                loss = pg
                if ref_lp is not None:
                    kl = k3_kl(logp, ref_lp[rows], mask)
                    loss = loss + algo.kl_loss_coef * kl
                    sums["kl_ref"] += kl.item()
                if algo.entropy_coef:
                    entropy = masked_entropy(log_softmax, mask)
                    loss = loss - algo.entropy_coef * entropy
                else:  # a metric only: no graph
                    with torch.no_grad():
                        entropy = masked_entropy(log_softmax.detach(), mask)
                (loss / step_tokens).backward()
                sums["loss"] += loss.item()
                sums["pg_loss"] += pg.item()
                sums["entropy"] += entropy.item()
                sums["ppo_kl"] += ((old_lp - logp.detach()) * mask).sum().item()
                sums["clipped"] += clipped.item()
                sums["tokens"] += mask.sum().item()
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, config.train.grad_clip)))
            optimizer.step()

    tokens = max(sums["tokens"], 1.0)
    mask_f = mask_all.float()
    mask_count = mask_f[measured].sum().clamp(min=1)
    metrics = {
        "loss": sums["loss"] / tokens,
        "pg_loss": sums["pg_loss"] / tokens,
        "entropy": sums["entropy"] / tokens,
        "ppo_kl": sums["ppo_kl"] / tokens,
        "clip_fraction": sums["clipped"] / tokens,
        "grad_norm": sum(grad_norms) / len(grad_norms),
        "optimizer_steps": len(grad_norms),
        "train_rollout_logprob_abs_diff": float(
            ((trainer_lp - rollout_lp).abs() * mask_f)[measured].sum() / mask_count
        ),
        # k1 estimate of KL(rollout policy || trainer policy) on the sampled tokens.
        "train_rollout_kl": float(((rollout_lp - trainer_lp) * mask_f)[measured].sum() / mask_count),
        "train_seconds": time.perf_counter() - started,
    }
    if ref_lp is not None:
        metrics["kl_ref"] = sums["kl_ref"] / tokens
    if algo.use_tis:
        raw = torch.exp(trainer_lp - rollout_lp)
        tis = tis_weights(trainer_lp, rollout_lp, algo.tis_clip_low, algo.tis_clip)
        metrics["tis_weight_mean"] = float((tis * mask_f).sum() / mask_count)
        metrics["tis_clip_fraction"] = float(((tis != raw) * mask_f).sum() / mask_count)
    return metrics
