"""CriticActor: PPO's value model, one rank of the critic's trainer group (algo.advantage_estimator=gae).

The critic is a trainer like the policy's (the same group machinery, sharding, dtype, checkpoints and ledger, in the
run directory's `critic/`), with a value head in place of the LM head and the value loss in place of the policy's. A
token's value is the critic's output at the token before it: the value of the state the token was sampled from.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, AutoModelForTokenClassification

from miles.config import RunConfig
from miles.state.seeds import train_seed
from miles.train.actor import TrainActor
from miles.train.algorithms import Algorithm
from miles.train.algorithms.aggregation import LossScale
from miles.train.algorithms.value import value_loss
from miles.train.batch import TrainBatch, batch_from_table
from miles.train.update import all_reduce_sum, clipped_step, prepare_batch, rank_micro_batches, set_lr


def token_values(model, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] float32: at each position the value head's output at the position before (0 at position 0)."""
    out = model(input_ids=tokens, attention_mask=attention_mask).logits[..., 0].float()
    return torch.nn.functional.pad(out[:, :-1], (1, 0))


class CriticActor(TrainActor):
    """Rank `rank` of `world_size` critic workers; `config` is the run's `critic_view()`."""

    holds_reference = False

    def _from_pretrained(self, source: Path) -> torch.nn.Module:
        config = AutoConfig.from_pretrained(source, num_labels=1)
        config.classifier_dropout = 0.0  # the token-classification head drops 0.1 by default: values need none
        return AutoModelForTokenClassification.from_pretrained(source, config=config, dtype=torch.float32)

    @torch.no_grad()
    def values(self, table: pa.Table) -> list[list[float]]:
        """Each sample's value at each of its response tokens, in the table's row order, on rank 0 (every rank takes
        a contiguous share of the rows and the same number of forwards; rank 0 gathers)."""
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        batch = batch_from_table(table, self.pad_token_id)
        share = np.array_split(np.arange(len(batch)), world)[rank]
        mine = batch.rows(torch.from_numpy(share))
        grid = torch.zeros(mine.tokens.shape, dtype=torch.float32)
        training = self.model.training
        self.model.eval()
        try:
            for rows in rank_micro_batches(mine, slice(0, len(mine)), self.config):
                mb = mine.rows(rows).trimmed()
                width = mb.tokens.shape[1]
                grid[rows, :width] = token_values(
                    self.model, mb.tokens.to(self.device), mb.attention_mask.to(self.device)
                ).cpu()
        finally:
            self.model.train(training)
            if isinstance(self.model, FSDPModule):
                # FSDP2 leaves the root's parameters gathered after a forward with no backward; a training step
                # on them would then give plain gradients beside the sharded ones
                self.model.reshard()
        lengths = table.column("response_length").to_numpy()[share]
        ends = mine.attention_mask.sum(dim=1).numpy()
        values = [
            grid[i, end - length : end].tolist() for i, (end, length) in enumerate(zip(ends, lengths, strict=True))
        ]
        if world == 1:
            return values
        gathered: list = [None] * world
        dist.all_gather_object(gathered, values)
        return [row for part in gathered for row in part]

    def train(self, rollout_id: int, table: pa.Table) -> dict[str, float]:
        """The critic's optimizer steps on the rollout (its `values` and `returns` columns) once; a second call for
        the same rollout_id returns its metrics."""
        if rollout_id in self.trained:
            return self.trained[rollout_id]
        torch.manual_seed(train_seed(self.config.seed, rollout_id, self.rank))
        config = self.config.at(rollout_id)
        set_lr(self.optimizer, config.critic.lr)
        metrics = value_update(self.model, self.optimizer, table, config, self.device, self.pad_token_id)
        self.trained[rollout_id] = metrics
        return metrics


def value_update(
    model, optimizer: torch.optim.Optimizer, table: pa.Table, config: RunConfig, device: torch.device, pad_token_id: int
) -> dict[str, float]:
    """`train.num_passes` passes of optimizer steps of the clipped value loss (miles.train.algorithms.value) over the
    rollout, a global batch each, aggregated as the policy's loss is; returns the rollout's critic metrics, summed
    over the ranks."""
    started = time.perf_counter()
    aggregate = Algorithm.from_config(config.algo).loss_aggregation
    batch, local_gbs = prepare_batch(table, config, pad_token_id)
    if batch.returns is None or batch.old_values is None:
        raise ValueError("the critic trains on a rollout with `values` and `returns` columns (get with gae)")
    params = list(model.parameters())
    sums = dict(loss=0.0, clipped=0.0, tokens=0.0)
    grad_norms = []
    for _ in range(config.train.num_passes):
        for start in range(0, len(batch), local_gbs):
            grad_norms.append(
                _value_step(
                    model, optimizer, params, batch, slice(start, start + local_gbs), config, aggregate, device, sums
                )
            )
    mask = batch.response_mask.float()
    residual = (batch.returns - batch.old_values) * mask
    local = {
        **sums,
        "n": float(mask.sum()),
        "returns": float((batch.returns * mask).sum()),
        "returns_sq": float((batch.returns**2 * mask).sum()),
        "values": float((batch.old_values * mask).sum()),
        "residual": float(residual.sum()),
        "residual_sq": float((residual**2).sum()),
    }
    total = dict(zip(local, all_reduce_sum(list(local.values())), strict=True))
    tokens, n = max(total["tokens"], 1.0), max(total["n"], 1.0)
    returns_var = total["returns_sq"] / n - (total["returns"] / n) ** 2
    residual_var = total["residual_sq"] / n - (total["residual"] / n) ** 2
    return {
        "value_loss": total["loss"] / tokens,
        "value_clip_fraction": total["clipped"] / tokens,
        "value_grad_norm": sum(grad_norms) / len(grad_norms),
        "value_mean": total["values"] / n,
        "returns_mean": total["returns"] / n,
        # 1 - Var(R - V) / Var(R): the share of the returns' variance the values the rollout was estimated with explain
        "value_explained_variance": 1.0 - residual_var / returns_var if returns_var > 0 else 0.0,
        "critic_seconds": time.perf_counter() - started,
    }


def _value_step(
    model,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    batch: TrainBatch,
    step_rows: slice,
    config: RunConfig,
    aggregate,
    device: torch.device,
    sums: dict[str, float],
) -> float:
    """One optimizer step of the value loss over one global batch (this rank's `step_rows`); its gradient norm."""
    mask_all = batch.response_mask
    step_tokens, step_sequences = all_reduce_sum([float(mask_all[step_rows].sum()), float(len(mask_all[step_rows]))])
    scale = LossScale(
        tokens=max(step_tokens, 1.0), sequences=int(step_sequences), horizon=config.rollout.max_model_tokens
    )
    optimizer.zero_grad(set_to_none=True)
    for micro in rank_micro_batches(batch, step_rows, config):
        mb = batch.rows(micro).trimmed()
        mask = mb.response_mask.to(device).float()
        predicted = token_values(model, mb.tokens.to(device), mb.attention_mask.to(device))
        per_token, clipped = value_loss(
            predicted, mb.old_values.to(device), mb.returns.to(device), config.critic.cliprange_value
        )
        aggregate(per_token, mask, scale).backward()
        sums["loss"] += float((per_token.detach() * mask).sum())
        sums["clipped"] += float((clipped * mask).sum())
        sums["tokens"] += float(mask.sum())
    return clipped_step(optimizer, params, config.train.grad_clip, "the critic's value loss")
