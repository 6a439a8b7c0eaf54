"""TrainActor: the policy, its optimizer and the GRPO/PPO update, run inside a Ray actor."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.checkpoint import (
    MODEL_DIR,
    STATE_FILE,
    Ledger,
    checkpoint_dir,
    checkpoint_root,
    commit_checkpoint,
    optimizer_from_files,
    optimizer_to_files,
    write_json_atomic,
)
from miles.config import RunConfig
from miles.train.batch import TrainBatch, batch_from_table
from miles.train.loss import k3_kl, ppo_clip_loss, tis_weights, token_entropy, token_logprobs

log = logging.getLogger(__name__)


class TrainActor:
    def __init__(self, config: RunConfig, model_dir: str, checkpoint: str | None = None, device: str = "cpu"):
        torch.set_num_threads(config.train.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.device = torch.device(device)
        self.run_dir = Path(config.run_dir)
        source = Path(checkpoint) / MODEL_DIR if checkpoint else Path(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(self.device).train()
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        self.pad_token_id = self.model.config.pad_token_id or 0
        train = config.train
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train.lr, betas=train.adam_betas, weight_decay=train.weight_decay
        )
        if checkpoint:
            optimizer_from_files(self.optimizer, Path(checkpoint))
        self.ref_model = None
        if config.algo.use_kl_loss:
            # The reference is the run's starting policy, not the checkpoint it resumed from.
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        self.ledger = Ledger(self.run_dir)

    def trained_rollouts(self) -> list[int]:
        return sorted(self.ledger.trained)

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        step = self.config.train.micro_batch_size
        parts = []
        for start in range(0, len(batch), step):
            mb = batch.rows(slice(start, start + step))
            logits = model(input_ids=mb.tokens.to(self.device), attention_mask=mb.attention_mask.to(self.device)).logits
            parts.append(token_logprobs(logits, mb.tokens.to(self.device), self.config.rollout.temperature))
        return torch.cat(parts)

    def train(self, rollout_id: int, table: pa.Table) -> dict[str, float]:
        """Run this rollout's optimizer steps once; a second call for the same rollout_id only returns its metrics."""
        if rollout_id in self.ledger.trained:
            return self.ledger.trained[rollout_id]
        started = time.perf_counter()
        cfg, algo = self.config, self.config.algo
        batch = batch_from_table(table, self.pad_token_id)
        mask_all = batch.response_mask.to(self.device)
        rollout_lp = batch.rollout_logprobs.to(self.device)
        gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
        # The policy before this rollout's first step: the first global batch's forward passes run before that
        # step, so they give its rows for free; the other rows need a forward now, before any step.
        trainer_lp = torch.zeros_like(rollout_lp)
        if len(batch) > gbs:
            trainer_lp[gbs:] = self._logprobs(self.model, batch.rows(slice(gbs, None)))
        ref_lp = self._logprobs(self.ref_model, batch) if self.ref_model is not None else None
        eps_high = algo.eps_clip_high if algo.eps_clip_high is not None else algo.eps_clip

        sums = dict(loss=0.0, pg_loss=0.0, kl_ref=0.0, entropy=0.0, ppo_kl=0.0, clipped=0.0, tokens=0.0)
        grad_norms = []
        for epoch in range(cfg.train.num_passes):
            for start in range(0, len(batch), gbs):
                step_tokens = mask_all[start : start + gbs].sum().clamp(min=1)
                self.optimizer.zero_grad(set_to_none=True)
                for m in range(start, start + gbs, mbs):
                    rows = slice(m, m + mbs)
                    mb = batch.rows(rows)
                    tokens = mb.tokens.to(self.device)
                    mask = mask_all[rows].float()
                    logits = self.model(input_ids=tokens, attention_mask=mb.attention_mask.to(self.device)).logits
                    logp = token_logprobs(logits, tokens, cfg.rollout.temperature)
                    if epoch == 0 and start == 0:
                        trainer_lp[rows] = logp.detach()
                    old_lp = rollout_lp[rows] if algo.use_rollout_logprobs else trainer_lp[rows]
                    tis = tis_weights(trainer_lp[rows], rollout_lp[rows], algo.tis_clip_low, algo.tis_clip) if algo.use_tis else None
                    pg, clipped = ppo_clip_loss(
                        logp, old_lp, mb.advantages.to(self.device), mask, algo.eps_clip, eps_high, token_weights=tis
                    )
                    loss = pg
                    if ref_lp is not None:
                        kl = k3_kl(logp, ref_lp[rows], mask)
                        loss = loss + algo.kl_loss_coef * kl
                        sums["kl_ref"] += kl.item()
                    entropy = (token_entropy(logits, cfg.rollout.temperature) * mask).sum()
                    if algo.entropy_coef:
                        loss = loss - algo.entropy_coef * entropy
                    (loss / step_tokens).backward()
                    sums["loss"] += loss.item()
                    sums["pg_loss"] += pg.item()
                    sums["entropy"] += entropy.item()
                    sums["ppo_kl"] += ((old_lp - logp.detach()) * mask).sum().item()
                    sums["clipped"] += clipped.item()
                    sums["tokens"] += mask.sum().item()
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.train.grad_clip)))
                self.optimizer.step()

        tokens = max(sums["tokens"], 1.0)
        mask_f = mask_all.float()
        mask_count = mask_f.sum().clamp(min=1)
        metrics = {
            "loss": sums["loss"] / tokens,
            "pg_loss": sums["pg_loss"] / tokens,
            "entropy": sums["entropy"] / tokens,
            "ppo_kl": sums["ppo_kl"] / tokens,
            "clip_fraction": sums["clipped"] / tokens,
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "optimizer_steps": len(grad_norms),
            "train_rollout_logprob_abs_diff": float(((trainer_lp - rollout_lp).abs() * mask_f).sum() / mask_count),
            # k1 estimate of KL(rollout policy || trainer policy) on the sampled tokens.
            "train_rollout_kl": float(((rollout_lp - trainer_lp) * mask_f).sum() / mask_count),
            "train_seconds": time.perf_counter() - started,
        }
        if ref_lp is not None:
            metrics["kl_ref"] = sums["kl_ref"] / tokens
        if algo.use_tis:
            raw = torch.exp(trainer_lp - rollout_lp)
            tis = tis_weights(trainer_lp, rollout_lp, algo.tis_clip_low, algo.tis_clip)
            metrics["tis_weight_mean"] = float((tis * mask_f).sum() / mask_count)
            metrics["tis_clip_fraction"] = float(((tis != raw) * mask_f).sum() / mask_count)
        self.ledger.record(rollout_id, metrics)
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, rollout_id: int, state: dict[str, Any]) -> str:
        """Write <run_dir>/checkpoints/<rollout_id>/ through a staging dir and one rename."""
        target = checkpoint_dir(self.run_dir, rollout_id)
        if target.exists():
            return str(target)
        root = checkpoint_root(self.run_dir)
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".staging-{rollout_id}-", dir=root))
        self.model.save_pretrained(staging / MODEL_DIR)
        self.tokenizer.save_pretrained(staging / MODEL_DIR)
        optimizer_to_files(self.optimizer, staging)
        write_json_atomic(staging / STATE_FILE, {**state, "rollout_id": rollout_id})
        commit_checkpoint(staging, target)
        return str(target)
