"""One rollout's policy update under the run's algorithm (`algo`): shared by the full-model TrainActor and the LoRA
trainer, which differ only in which parameters the optimizer holds."""

from __future__ import annotations

import time
from collections.abc import Callable

import pyarrow as pa
import torch

from miles.config import AlgoConfig, RunConfig
from miles.train.algorithms import Algorithm
from miles.train.algorithms.aggregation import LossScale
from miles.train.algorithms.off_policy import importance_weights
from miles.train.batch import TrainBatch, batch_from_table
from miles.train.logprobs import next_token_log_softmax, picked_logprobs, token_entropy, token_logprobs

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


def token_advantages(
    advantages: torch.Tensor,
    mask: torch.Tensor,
    algo: AlgoConfig,
    algorithm: Algorithm,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
) -> torch.Tensor:
    """Each sample's advantage on each of its tokens ([B, T]). With `algo.kl_in_reward` every token also earns the
    reward -kl_reward_coef * KL_t (old policy vs reference), and its advantage gains that penalty's return to go,
    sum over t' >= t, undiscounted and unnormalised (the REINFORCE return of a per-token reward, as in Ouyang et al.
    2022, arXiv:2203.02155, eq. 2, and REINFORCE++); the estimator's outcome advantage is left as it is."""
    per_token = advantages.unsqueeze(1).expand_as(mask)
    if not algo.kl_in_reward:
        return per_token
    penalty = algorithm.kl_estimator(old_logprobs, ref_logprobs).detach() * mask
    return per_token - algo.kl_reward_coef * penalty.flip(1).cumsum(1).flip(1)


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
    """`num_passes` passes of samples / global_batch_size optimizer steps over the rollout; returns its metrics.

    Per micro-batch: loss = aggregate(policy_loss * importance weight) + kl_loss_coef * aggregate(KL)
    - entropy_coef * aggregate(entropy), each aggregate normalised over the micro-batch's global batch."""
    started = time.perf_counter()
    algo = config.algo
    algorithm = Algorithm.from_config(algo)
    aggregate = algorithm.loss_aggregation
    batch = batch_from_table(table, pad_token_id)
    mask_all = batch.response_mask.to(device)
    rollout_lp = batch.rollout_logprobs.to(device)
    gbs, mbs = config.train.global_batch_size, config.train.micro_batch_size
    # The policy before this rollout's first step: the first global batch's forward passes run before that
    # step, so they give its rows for free. The other rows need a forward now, before any step, when the loss uses
    # them (as the old policy, or for the off-policy weight); otherwise the trainer-vs-rollout metrics cover the
    # first batch only.
    trainer_lp = torch.zeros_like(rollout_lp)
    needs_old_policy = not algo.use_rollout_logprobs or algo.corrects_off_policy
    if len(batch) > gbs and needs_old_policy:
        trainer_lp[gbs:] = batch_logprobs(model, batch.rows(slice(gbs, None)), config, device)
    measured = slice(None) if needs_old_policy else slice(0, gbs)
    ref_lp = reference(batch) if reference is not None else None

    sums = dict(pg_loss=0.0, kl_ref=0.0, entropy=0.0, ppo_kl=0.0, clipped=0.0, tokens=0.0)
    step_losses, grad_norms = [], []
    for pass_ in range(config.train.num_passes):
        for start in range(0, len(batch), gbs):
            scale = LossScale(
                tokens=float(mask_all[start : start + gbs].sum().clamp(min=1)),
                sequences=gbs,
                horizon=config.rollout.max_new_tokens,
            )
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
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
                ref_rows = ref_lp[rows] if ref_lp is not None else None
                advantages = token_advantages(mb.advantages.to(device), mask, algo, algorithm, old_lp, ref_rows)
                pg, clipped = algorithm.policy_loss(logp, old_lp, advantages, mask, algo)
                if algo.corrects_off_policy:
                    pg = pg * importance_weights(trainer_lp[rows], rollout_lp[rows], mask, algo)[0]
                loss = aggregate(pg, mask, scale)
                if algo.use_kl_loss:
                    kl = algorithm.kl_estimator(logp, ref_rows)
                    loss = loss + algo.kl_loss_coef * aggregate(kl, mask, scale)
                    sums["kl_ref"] += float((kl.detach() * mask).sum())
                if algo.entropy_coef:
                    entropy = token_entropy(log_softmax, mask)
                    loss = loss - algo.entropy_coef * aggregate(entropy, mask, scale)
                else:  # a metric only: no graph
                    with torch.no_grad():
                        entropy = token_entropy(log_softmax.detach(), mask)
                loss.backward()
                step_loss += float(loss.detach())
                sums["pg_loss"] += float((pg.detach() * mask).sum())
                sums["entropy"] += float((entropy.detach() * mask).sum())
                sums["ppo_kl"] += float(((old_lp - logp.detach()) * mask).sum())
                sums["clipped"] += float((clipped * mask).sum())
                sums["tokens"] += float(mask.sum())
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, config.train.grad_clip)))
            step_losses.append(step_loss)
            optimizer.step()

    tokens = max(sums["tokens"], 1.0)
    mask_f = mask_all.float()
    mask_count = mask_f[measured].sum().clamp(min=1)
    metrics = {
        "loss": sum(step_losses) / len(step_losses),
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
    if algo.use_kl_loss:
        metrics["kl_ref"] = sums["kl_ref"] / tokens
    if algo.corrects_off_policy:
        weights, changed = importance_weights(trainer_lp, rollout_lp, mask_f, algo)
        metrics["tis_weight_mean"] = float((weights * mask_f).sum() / mask_count)
        metrics["tis_clip_fraction"] = float((changed * mask_f).sum() / mask_count)
    return metrics
