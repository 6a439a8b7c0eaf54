"""TrainActor: the policy, its optimizer and the RL update, run inside a Ray actor."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.checkpoint import MODEL_DIR, optimizer_from_files, optimizer_to_files, write_checkpoint
from miles.config import RunConfig
from miles.run_dir import RunDir
from miles.train.sharding import full_state_dict
from miles.train.update import batch_logprobs, train_on_rollout

log = logging.getLogger(__name__)


class TrainActor:
    def __init__(self, config: RunConfig, model_dir: str, checkpoint: str | None = None, device: str = "cpu"):
        torch.set_num_threads(config.train.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.device = torch.device(device)
        self.run_dir = RunDir(config.run_dir)
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
        if config.algo.needs_reference:
            # The reference is the run's starting policy, not the checkpoint it resumed from.
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        self.ledger = self.run_dir.ledger()

    def trained_rollouts(self) -> list[int]:
        return sorted(self.ledger.trained)

    def train(self, rollout_id: int, table: pa.Table) -> dict[str, float]:
        """Run this rollout's optimizer steps once; a second call for the same rollout_id only returns its metrics."""
        if rollout_id in self.ledger.trained:
            return self.ledger.trained[rollout_id]
        reference = None
        if self.ref_model is not None:
            reference = partial(batch_logprobs, self.ref_model, config=self.config, device=self.device)
        metrics = train_on_rollout(
            self.model,
            self.optimizer,
            list(self.model.parameters()),
            table,
            self.config,
            self.device,
            self.pad_token_id,
            reference,
        )
        self.ledger.record(rollout_id, metrics)
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)

    def save_checkpoint(self, rollout_id: int, state: dict[str, Any]) -> str:
        """Write the run's checkpoint of `rollout_id`: the model in HF format, the optimizer and the state."""
        target = self.run_dir.checkpoint(rollout_id)
        return str(write_checkpoint(target, rollout_id, state, self._write_checkpoint_files))

    def _write_checkpoint_files(self, directory: Path) -> None:
        self.model.save_pretrained(directory / MODEL_DIR)
        self.tokenizer.save_pretrained(directory / MODEL_DIR)
        optimizer_to_files(self.optimizer, directory)
