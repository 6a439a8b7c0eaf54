"""One rollout's policy update under the run's algorithm (`algo`): shared by the full-model TrainActor and the LoRA
trainer, which differ only in which parameters the optimizer holds."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from miles.config import AlgoConfig, RunConfig
from miles.train.algorithms import Algorithm
from miles.train.algorithms.aggregation import LossScale
from miles.train.algorithms.kl import adaptive_kl_coef
from miles.train.algorithms.off_policy import importance_weights, kept_by_rejection
from miles.train.algorithms.value import gae
from miles.train.batch import TrainBatch, batch_from_table, micro_batches, split_to
from miles.train.logprobs import token_stats

ReferenceLogprobs = Callable[[TrainBatch], torch.Tensor]


class NonFiniteGradient(ValueError):
    """A loss or gradient turned NaN or infinite. A ValueError: a retry of the same data would meet it again."""


@torch.no_grad()
def batch_logprobs(model, batch: TrainBatch, config: RunConfig, device: torch.device) -> torch.Tensor:
    """Per-token log-probs of the batch's tokens under `model`, micro-batch by micro-batch, in eval mode (no
    dropout: these are the old or reference policy's log-probs, not a training forward)."""
    width = batch.tokens.shape[1]
    parts = []
    training = model.training
    model.eval()
    try:
        for rows in rank_micro_batches(batch, slice(0, len(batch)), config):
            mb = batch.rows(rows).trimmed()
            tokens = mb.tokens.to(device)
            logprobs, _ = token_stats(
                model, tokens, mb.attention_mask.to(device), config.rollout.temperature, config.train.logits_chunk_mb
            )
            parts.append(torch.nn.functional.pad(logprobs, (0, width - logprobs.shape[1])))
    finally:
        model.train(training)
    return torch.cat(parts)


def rank_micro_batches(batch: TrainBatch, rows: slice, config: RunConfig) -> list[slice]:
    """The micro-batches of `rows` (absolute row slices): at most train.micro_batch_size samples and, with
    train.max_tokens_per_micro_batch, at most that many padded tokens; in a process group, as many on every rank
    (the most any rank needs), since each forward of a sharded model is a collective."""
    lengths = batch.lengths()[rows]
    bounds = micro_batches(lengths, config.train.micro_batch_size, config.train.max_tokens_per_micro_batch)
    if dist.is_initialized() and dist.get_world_size() > 1:
        count = torch.tensor([len(bounds)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        bounds = split_to(bounds, lengths, int(count))
    return [slice(rows.start + b.start, rows.start + b.stop) for b in bounds]


def token_advantages(
    advantages: torch.Tensor,
    mask: torch.Tensor,
    algo: AlgoConfig,
    algorithm: Algorithm,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each token's advantage ([B, T]): `advantages` as they are when given per token (GAE's, estimated at `get`),
    else each sample's on each of its tokens; and the per-token KL penalty (None without kl_in_reward).

    With `algo.kl_in_reward` every token also earns the reward -kl_reward_coef * KL_t (old policy vs reference), and
    its advantage gains that penalty's return to go, sum over t' >= t of (gamma lam)^(t'-t) -kl_reward_coef KL_t'
    (the estimator's discount: gamma = lam = 1 without a critic, the REINFORCE return of a per-token reward, as in Ouyang et al. 2022,
    arXiv:2203.02155, eq. 2, and REINFORCE++). GAE is linear in the rewards, so with a critic this is the penalty's
    part of GAE, with no baseline: the critic learns the outcome reward's value."""
    per_token = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand_as(mask)
    if not algo.kl_in_reward:
        return per_token, None
    penalty = algorithm.kl_estimator(old_logprobs, ref_logprobs).detach() * mask
    gamma, lam = algorithm.advantage_estimator.discount
    penalty_to_go, _ = gae(penalty, torch.zeros_like(penalty), mask, gamma, lam)
    return per_token - algo.kl_reward_coef * penalty_to_go, penalty


def with_kl_reward_coef(config: RunConfig, trained: dict[int, dict[str, float]], rollout_id: int) -> RunConfig:
    """The config that trains `rollout_id`: with algo.kl_reward_target set, its kl_reward_coef is the adaptive
    controller's after the rollouts trained before it (their `kl_in_reward` metrics), so a retry or a replay of the
    rollout gets the same coefficient."""
    algo = config.algo
    if not (algo.kl_in_reward and algo.kl_reward_target is not None):
        return config
    history = [trained[i]["kl_in_reward"] for i in sorted(trained) if i < rollout_id]
    coef = adaptive_kl_coef(algo.kl_reward_coef, history, algo.kl_reward_target, algo.kl_reward_gain)
    return config.model_copy(update={"algo": algo.model_copy(update={"kl_reward_coef": coef})})


def rank_rows(token_counts: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Each rank's rows of one global batch ([gbs] trained tokens per row): the same number of rows per rank (FSDP's
    collectives need every rank to run the same forwards), balanced by tokens by dealing the rows, longest first,
    in snake order (0, 1, .., N-1, N-1, .., 0); each rank's rows in their original order."""
    order = torch.argsort(token_counts, descending=True, stable=True)
    position = torch.arange(len(order))
    turn, seat = position // world, position % world
    owner = torch.where(turn % 2 == 0, seat, world - 1 - seat)
    return [torch.sort(order[owner == rank]).values for rank in range(world)]


def all_reduce_sum(values: list[float]) -> list[float]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return values
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    return total.tolist()


def prepare_batch(table: pa.Table, config: RunConfig, pad_token_id: int) -> tuple[TrainBatch, int]:
    """Stage 1, batch preparation: the rollout as padded tensors, this rank's share of every global batch
    (`rank_rows`; the last one may be short), each global batch longest first; with the rows per rank of one global
    batch."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    batch = batch_from_table(table, pad_token_id)
    gbs = config.train.global_batch_size
    if gbs % world or len(batch) % world:
        raise ValueError(
            f"train.global_batch_size ({gbs}) and the rollout's {len(batch)} samples must split evenly over the "
            f"{world} ranks"
        )
    if world > 1:
        counts = batch.response_mask.sum(dim=1)
        batch = batch.rows(
            torch.cat(
                [start + rank_rows(counts[start : start + gbs], world)[rank] for start in range(0, len(batch), gbs)]
            )
        )
    local_gbs = gbs // world
    return batch.by_length(local_gbs), local_gbs


@dataclass
class PolicyLogprobs:
    """Stage 2, the log-probs the loss compares the policy with, per token of the batch ([B, T]): the engine's
    (`rollout`), the trainer's before this rollout's first step (`old`), the reference policy's (`reference`).

    `old` of the first global batch is filled by that batch's own forward passes, which run before the first step
    and so give it for free (`fill_old`), unless the model has dropout (a training forward is then not the old
    policy's); the other rows get an eval-mode forward now, before any step, when the loss uses them (as the old
    policy, or for the off-policy weight). Otherwise the trainer-vs-rollout metrics cover the first global batch
    only (`measured`)."""

    rollout: torch.Tensor
    old: torch.Tensor
    reference: torch.Tensor | None
    measured: slice
    use_rollout_logprobs: bool
    old_from_training: bool

    def old_policy(self, rows: tuple[slice, slice]) -> torch.Tensor:
        """The old policy of the ratio: the engine's log-probs (algo.use_rollout_logprobs) or the trainer's."""
        return self.rollout[rows] if self.use_rollout_logprobs else self.old[rows]

    def fill_old(self, rows: tuple[slice, slice], logprobs: torch.Tensor) -> None:
        if self.old_from_training:
            self.old[rows] = logprobs.detach()


def dropout_active(model: torch.nn.Module) -> bool:
    """Whether a training forward drops anything: a dropout module with p > 0, or a dropout rate in the config
    (attention dropout is a functional argument in transformers' models, not a module)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    rates = model.config.to_dict().items()
    return any(
        ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value > 0 for key, value in rates
    )


def policy_logprobs(
    model,
    batch: TrainBatch,
    local_gbs: int,
    config: RunConfig,
    device: torch.device,
    reference: ReferenceLogprobs | None,
) -> PolicyLogprobs:
    algo = config.algo
    rollout = batch.rollout_logprobs.to(device)
    old = torch.zeros_like(rollout)
    old_from_training = not dropout_active(model)
    needs_old_policy = not algo.use_rollout_logprobs or algo.corrects_off_policy or not old_from_training
    first = local_gbs if old_from_training else 0
    if len(batch) > first and needs_old_policy:
        old[first:] = batch_logprobs(model, batch.rows(slice(first, None)), config, device)
    return PolicyLogprobs(
        rollout=rollout,
        old=old,
        reference=reference(batch) if reference is not None else None,
        measured=slice(None) if needs_old_policy else slice(0, local_gbs),
        use_rollout_logprobs=algo.use_rollout_logprobs,
        old_from_training=old_from_training,
    )


def micro_batch_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rows: tuple[slice, slice],
    logprobs: PolicyLogprobs,
    algo: AlgoConfig,
    algorithm: Algorithm,
    scale: LossScale,
    sums: dict[str, float],
) -> torch.Tensor:
    """Stage 4, the loss of one micro-batch: aggregate(policy_loss * importance weight) + kl_loss_coef *
    aggregate(KL) - entropy_coef * aggregate(entropy) (`entropy`: per token, with a gradient only when
    entropy_coef is set), each aggregate normalised over the micro-batch's global batch
    (`scale`); adds the micro-batch's metric sums to `sums`."""
    aggregate = algorithm.loss_aggregation
    old_lp = logprobs.old_policy(rows)
    pg, clipped = algorithm.policy_loss(logp, old_lp, advantages, mask, algo)
    if algo.corrects_off_policy:
        pg = pg * importance_weights(logprobs.old[rows], logprobs.rollout[rows], mask, algo)[0]
    if algo.rejection_level != "off":
        pg = pg * kept_by_rejection(logprobs.old[rows], logprobs.rollout[rows], mask, algo)
    loss = aggregate(pg, mask, scale)
    if algo.use_kl_loss:
        kl = algorithm.kl_estimator(logp, logprobs.reference[rows])
        loss = loss + algo.kl_loss_coef * aggregate(kl, mask, scale)
        sums["kl_ref"] += float((kl.detach() * mask).sum())
    if algo.entropy_coef:
        loss = loss - algo.entropy_coef * aggregate(entropy, mask, scale)
    sums["pg_loss"] += float((pg.detach() * mask).sum())
    sums["entropy"] += float((entropy.detach() * mask).sum())
    sums["ppo_kl"] += float(((old_lp - logp.detach()) * mask).sum())
    sums["clipped"] += float((clipped * mask).sum())
    sums["tokens"] += float(mask.sum())
    return loss


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The learning rate in effect for the next steps (a run's config may change it at a rollout)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def sum_replicated_gradients(params: list[torch.nn.Parameter]) -> None:
    """In a process group, sum over the ranks the gradients of the parameters every rank holds whole (LoRA adapters
    beside a sharded base), as FSDP's reduce-scatter sums the sharded ones: each rank's loss is its share of the global
    batch's. One collective over the flattened gradients; a parameter without a gradient on a rank counts as zeros."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    whole = [p for p in params if not isinstance(p, DTensor)]
    if not whole:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in whole]
    summed = _flatten_dense_tensors(grads)
    dist.all_reduce(summed)
    for param, grad in zip(whole, _unflatten_dense_tensors(summed, grads), strict=True):
        param.grad = grad


def optimizer_step(
    model,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    batch: TrainBatch,
    step_rows: slice,
    first_pass: bool,
    logprobs: PolicyLogprobs,
    config: RunConfig,
    algorithm: Algorithm,
    device: torch.device,
    sums: dict[str, float],
) -> tuple[float, float]:
    """Stage 5, one optimizer step over one global batch (this rank's `step_rows` of it; the rollout's last global
    batch may be short, and its denominators are its own): per micro-batch the
    forward, the per-token advantages (stage 3, `token_advantages`), the loss (stage 4) and its backward; then the
    gradient clip and the step. Returns the step's loss and gradient norm."""
    algo = config.algo
    mask_all = batch.response_mask
    step_tokens, step_sequences = all_reduce_sum([float(mask_all[step_rows].sum()), float(len(mask_all[step_rows]))])
    scale = LossScale(
        tokens=max(step_tokens, 1.0), sequences=int(step_sequences), horizon=config.rollout.max_model_tokens
    )
    optimizer.zero_grad(set_to_none=True)
    step_loss = 0.0
    for micro in rank_micro_batches(batch, step_rows, config):
        mb = batch.rows(micro).trimmed()
        rows = (micro, slice(0, mb.tokens.shape[1]))  # the micro-batch's rows and columns
        tokens = mb.tokens.to(device)
        mask = mask_all[rows].to(device).float()
        logp, entropy = token_stats(
            model,
            tokens,
            mb.attention_mask.to(device),
            config.rollout.temperature,
            config.train.logits_chunk_mb,
            entropy_grad=bool(algo.entropy_coef),
        )
        if first_pass and step_rows.start == 0:
            logprobs.fill_old(rows, logp)
        reference = logprobs.reference[rows] if logprobs.reference is not None else None
        sample_or_token = mb.advantages if mb.token_advantages is None else mb.token_advantages
        advantages, penalty = token_advantages(
            sample_or_token.to(device), mask, algo, algorithm, logprobs.old_policy(rows), reference
        )
        if penalty is not None:
            sums["kl_in_reward"] += float(penalty.sum())
        loss = micro_batch_loss(logp, entropy, advantages, mask, rows, logprobs, algo, algorithm, scale, sums)
        loss.backward()
        step_loss += float(loss.detach())
    return step_loss, clipped_step(optimizer, params, config.train.grad_clip, f"loss {step_loss}")


def clipped_step(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], grad_clip: float, what: str
) -> float:
    """The optimizer step on the accumulated gradients, summed over the ranks where a parameter is whole on each,
    clipped to `grad_clip` in global norm; returns that norm. A NaN or infinite norm takes no step (NonFiniteGradient,
    with `what` in its message)."""
    sum_replicated_gradients(params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    # sharded parameters give the norm as a DTensor; its full value is the global norm
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not math.isfinite(grad_norm):
        raise NonFiniteGradient(
            f"the gradient norm is {grad_norm} ({what}); the optimizer step is not taken, and the weights hold the "
            "steps before it"
        )
    optimizer.step()
    return grad_norm


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
    """`num_passes` passes of ceil(samples / global_batch_size) optimizer steps over the rollout (the last one over
    what is left); returns its metrics.
    In stages: batch preparation -> old and reference log-probs -> per optimizer step and micro-batch, per-token
    advantages -> loss -> the optimizer step.

    In a process group of N ranks (an FSDP-sharded model, gradients summed across ranks), each rank trains on its
    share of every global batch (`rank_rows`); the aggregation's denominators and the metrics are summed over the
    ranks, so the update and the metrics equal a single process's."""
    started = time.perf_counter()
    algorithm = Algorithm.from_config(config.algo)
    batch, local_gbs = prepare_batch(table, config, pad_token_id)
    logprobs = policy_logprobs(model, batch, local_gbs, config, device, reference)
    sums = dict(pg_loss=0.0, kl_ref=0.0, kl_in_reward=0.0, entropy=0.0, ppo_kl=0.0, clipped=0.0, tokens=0.0)
    step_losses, grad_norms = [], []
    for pass_ in range(config.train.num_passes):
        for start in range(0, len(batch), local_gbs):
            step_loss, grad_norm = optimizer_step(
                model,
                optimizer,
                params,
                batch,
                slice(start, start + local_gbs),
                pass_ == 0,
                logprobs,
                config,
                algorithm,
                device,
                sums,
            )
            step_losses.append(step_loss)
            grad_norms.append(grad_norm)
    metrics = rollout_metrics(batch, logprobs, config.algo, sums, step_losses, grad_norms)
    metrics["train_seconds"] = time.perf_counter() - started
    return metrics


def rollout_metrics(
    batch: TrainBatch,
    logprobs: PolicyLogprobs,
    algo: AlgoConfig,
    sums: dict[str, float],
    step_losses: list[float],
    grad_norms: list[float],
) -> dict[str, float]:
    """The rollout's metrics, summed over the ranks: per-token means of the loss terms, and how far the trainer's
    log-probs are from the engine's on the measured rows."""
    measured = logprobs.measured
    mask_f = batch.response_mask.to(logprobs.old.device).float()[measured]
    gap = (logprobs.old - logprobs.rollout)[measured]
    local = {
        **sums,
        "step_losses": sum(step_losses),
        "measured_tokens": float(mask_f.sum()),
        "abs_gap": float((gap.abs() * mask_f).sum()),
        "gap": float((gap * mask_f).sum()),
    }
    if algo.corrects_off_policy:
        weights, changed = importance_weights(logprobs.old[measured], logprobs.rollout[measured], mask_f, algo)
        local["tis_weights"] = float((weights * mask_f).sum())
        local["tis_changed"] = float((changed * mask_f).sum())
    if algo.rejection_level != "off":
        kept = kept_by_rejection(logprobs.old[measured], logprobs.rollout[measured], mask_f, algo)
        local["rejected"] = float((~kept * mask_f).sum())
    total = dict(zip(local, all_reduce_sum(list(local.values())), strict=True))
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
    }
    if algo.use_kl_loss:
        metrics["kl_ref"] = total["kl_ref"] / tokens
    if algo.kl_in_reward:
        metrics["kl_in_reward"] = total["kl_in_reward"] / tokens
        metrics["kl_reward_coef"] = algo.kl_reward_coef
    if algo.corrects_off_policy:
        metrics["tis_weight_mean"] = total["tis_weights"] / measured_tokens
        metrics["tis_clip_fraction"] = total["tis_changed"] / measured_tokens
    if algo.rejection_level != "off":
        metrics["rejected_fraction"] = total["rejected"] / measured_tokens
    return metrics
