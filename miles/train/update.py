"""One rollout's policy update under the run's algorithm (`algo`): shared by the full-model TrainActor and the LoRA
trainer, which differ only in which parameters the optimizer holds."""

from __future__ import annotations

import time
from collections.abc import Callable

import pyarrow as pa
import torch
import torch.distributed as dist

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
    width = batch.tokens.shape[1]
    parts = []
    for start in range(0, len(batch), step):
        mb = batch.rows(slice(start, start + step)).trimmed()
        logits = model(input_ids=mb.tokens.to(device), attention_mask=mb.attention_mask.to(device)).logits
        logprobs = token_logprobs(logits, mb.tokens.to(device), config.rollout.temperature)
        parts.append(torch.nn.functional.pad(logprobs, (0, width - logprobs.shape[1])))
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


def rank_rows(token_counts: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Each rank's rows of one global batch ([gbs] trained tokens per row): the same number of rows per rank (FSDP's
    collectives need every rank to run the same forwards), balanced by tokens by dealing the rows, longest first,
    in snake order (0, 1, .., N-1, N-1, .., 0); each rank's rows in their original order."""
    order = torch.argsort(token_counts, descending=True, stable=True)
    position = torch.arange(len(order))
    turn, seat = position // world, position % world
    owner = torch.where(turn % 2 == 0, seat, world - 1 - seat)
    return [torch.sort(order[owner == rank]).values for rank in range(world)]


def _all_reduce_sum(values: list[float]) -> list[float]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return values
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    return total.tolist()


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
    - entropy_coef * aggregate(entropy), each aggregate normalised over the micro-batch's global batch.

    In a process group of N ranks (an FSDP-sharded model, gradients summed across ranks), each rank trains on its
    share of every global batch (`rank_rows`); the aggregation's denominators and the metrics are summed over the
    ranks, so the update and the metrics equal a single process's."""
    started = time.perf_counter()
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    algo = config.algo
    algorithm = Algorithm.from_config(algo)
    aggregate = algorithm.loss_aggregation
    batch = batch_from_table(table, pad_token_id)
    gbs = config.train.global_batch_size
    if gbs % world:
        raise ValueError(f"train.global_batch_size ({gbs}) must split evenly over the {world} ranks")
    if world > 1:
        counts = batch.response_mask.sum(dim=1)
        batch = batch.rows(
            torch.cat(
                [start + rank_rows(counts[start : start + gbs], world)[rank] for start in range(0, len(batch), gbs)]
            )
        )
    local_gbs = gbs // world
    batch = batch.by_length(local_gbs)
    mbs = min(config.train.micro_batch_size, local_gbs)
    mask_all = batch.response_mask.to(device)
    rollout_lp = batch.rollout_logprobs.to(device)
    # The policy before this rollout's first step: the first global batch's forward passes run before that
    # step, so they give its rows for free. The other rows need a forward now, before any step, when the loss uses
    # them (as the old policy, or for the off-policy weight); otherwise the trainer-vs-rollout metrics cover the
    # first batch only.
    trainer_lp = torch.zeros_like(rollout_lp)
    needs_old_policy = not algo.use_rollout_logprobs or algo.corrects_off_policy
    if len(batch) > local_gbs and needs_old_policy:
        trainer_lp[local_gbs:] = batch_logprobs(model, batch.rows(slice(local_gbs, None)), config, device)
    measured = slice(None) if needs_old_policy else slice(0, local_gbs)
    ref_lp = reference(batch) if reference is not None else None

    sums = dict(pg_loss=0.0, kl_ref=0.0, entropy=0.0, ppo_kl=0.0, clipped=0.0, tokens=0.0)
    step_losses, grad_norms = [], []
    for pass_ in range(config.train.num_passes):
        for start in range(0, len(batch), local_gbs):
            (step_tokens,) = _all_reduce_sum([float(mask_all[start : start + local_gbs].sum())])
            scale = LossScale(tokens=max(step_tokens, 1.0), sequences=gbs, horizon=config.rollout.max_model_tokens)
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for m in range(start, start + local_gbs, mbs):
                mb = batch.rows(slice(m, m + mbs)).trimmed()
                rows = (slice(m, m + mbs), slice(0, mb.tokens.shape[1]))  # the micro-batch's rows and columns
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
            grad_norm = torch.nn.utils.clip_grad_norm_(params, config.train.grad_clip)
            # sharded parameters give the norm as a DTensor; its full value is the global norm
            grad_norms.append(float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm))
            step_losses.append(step_loss)
            optimizer.step()

    mask_f = mask_all.float()[measured]
    gap = (trainer_lp - rollout_lp)[measured]
    local = {
        **sums,
        "step_losses": sum(step_losses),
        "measured_tokens": float(mask_f.sum()),
        "abs_gap": float((gap.abs() * mask_f).sum()),
        "gap": float((gap * mask_f).sum()),
    }
    if algo.corrects_off_policy:
        weights, changed = importance_weights(trainer_lp[measured], rollout_lp[measured], mask_f, algo)
        local["tis_weights"] = float((weights * mask_f).sum())
        local["tis_changed"] = float((changed * mask_f).sum())
    total = dict(zip(local, _all_reduce_sum(list(local.values())), strict=True))
    tokens = max(total["tokens"], 1.0)
    measured_tokens = max(total["measured_tokens"], 1.0)
    metrics = {
        "loss": total["step_losses"] / len(step_losses),
        "pg_loss": total["pg_loss"] / tokens,
        "entropy": total["entropy"] / tokens,
        "ppo_kl": total["ppo_kl"] / tokens,
        "clip_fraction": total["clipped"] / tokens,
        "grad_norm": sum(grad_norms) / len(grad_norms),
        "optimizer_steps": len(grad_norms),
        "train_rollout_logprob_abs_diff": total["abs_gap"] / measured_tokens,
        # k1 estimate of KL(rollout policy || trainer policy) on the sampled tokens.
        "train_rollout_kl": -total["gap"] / measured_tokens,
        "train_seconds": time.perf_counter() - started,
    }
    if algo.use_kl_loss:
        metrics["kl_ref"] = total["kl_ref"] / tokens
    if algo.corrects_off_policy:
        metrics["tis_weight_mean"] = total["tis_weights"] / measured_tokens
        metrics["tis_clip_fraction"] = total["tis_changed"] / measured_tokens
    return metrics
