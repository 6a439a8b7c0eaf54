"""LoRATrainActor: several peft LoRA adapters on one frozen base model, each with its own optimizer; one rank of a
LoRA trainer group.

The frozen base is held in the model's dtype (bf16 for a bf16 model; train.param_dtype=bfloat16 narrows a float32 one)
and, with train.sharding=fsdp, sharded by FSDP2 over the group's ranks; it never changes, so it has no gradients, no
optimizer state and no float32 master copy. The adapters and their optimizer state are float32 and whole on every
rank: each rank trains on its share of every global batch, and the adapters' gradients are summed over the ranks
before each step (miles.train.update), so every rank holds the same adapters.

A `train(name, rollout_id, table)` call activates that adapter, so only its parameters get gradients and only
its optimizer steps. Checkpoints hold the adapter as a PEFT directory (`adapter_config.json` +
`adapter_model.safetensors`) that `PeftModel.from_pretrained(base, dir)` loads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from miles.cluster.placement import torch_device
from miles.config import AdapterConfig, RunConfig
from miles.state.checkpoint import (
    ADAPTER_DIR,
    load_optimizer,
    save_optimizer,
    weights_dtype,
    write_checkpoint_from_ranks,
)
from miles.state.run_dir import RunDir
from miles.state.seeds import adapter_init_seed, train_seed
from miles.train.sharding import join_trainer_group, shard_model
from miles.train.update import batch_logprobs, train_on_rollout, with_kl_reward_coef

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_key(key: str, adapter: str) -> bool:
    """Whether a parameter or state-dict key belongs to LoRA adapter `adapter` (peft names them lora_A.<adapter>....)."""
    return re.search(rf"\.lora_\w+\.{re.escape(adapter)}\.", key) is not None


def lora_config(adapter: AdapterConfig) -> LoraConfig:
    return LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        target_modules=list(adapter.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def config_dict(config: LoraConfig) -> dict[str, Any]:
    """The adapter_config.json contents, JSON-safe (peft keeps target_modules as a set)."""
    return json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


@dataclass
class _Adapter:
    config: RunConfig  # the adapter's view of the run: its data, batch sizes, lr and directory
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    run_dir: RunDir
    trained: dict[int, dict[str, float]]  # the adapter's ledger when added, then each rollout trained since


def base_dtype(config: RunConfig, base_dir: Path) -> str:
    """The dtype the frozen base is held in: the model's own, or bfloat16 where train.param_dtype asks for it."""
    return "bfloat16" if config.train.param_dtype == "bfloat16" else weights_dtype(base_dir)


class LoRATrainActor:
    """Rank `rank` of `world_size` LoRA trainer workers; every rank gets every call, in the same order."""

    def __init__(
        self,
        config: RunConfig,
        base_dir: str,
        rank: int = 0,
        world_size: int = 1,
        rendezvous: str | None = None,
    ):
        train = config.train
        torch.set_num_threads(train.num_threads)
        self.config = config
        self.rank = rank
        self.device = torch_device(train.device)
        self.base_dir = base_dir
        if train.sharded:
            join_trainer_group(self.device, rendezvous, rank, world_size)
        dtype = base_dtype(config, Path(base_dir))
        self.model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=getattr(torch, dtype))
        self.model.requires_grad_(False)
        if train.sharded:  # before peft: the adapters stay whole, beside it
            shard_model(self.model, self.device.type, dtype)
        else:
            self.model.to(self.device)
        self.pad_token_id = self.model.config.pad_token_id or 0
        self.adapters: dict[str, _Adapter] = {}

    def add_adapter(self, adapter: AdapterConfig, view: RunConfig, checkpoint: str | None = None) -> None:
        """Create adapter `adapter.name` (seeded from the run seed and its name), or restore it from a checkpoint."""
        name = adapter.name
        if name in self.adapters:
            return
        lora = lora_config(adapter)
        torch.manual_seed(adapter_init_seed(self.config.seed, name))
        # float32 adapters on a narrower base (peft casts them to the base's dtype otherwise)
        if isinstance(self.model, PeftModel):
            self.model.add_adapter(name, lora, autocast_adapter_dtype=True)
        else:
            self.model = get_peft_model(self.model, lora, adapter_name=name, autocast_adapter_dtype=True)
        if checkpoint:
            weights = load_file(str(Path(checkpoint) / ADAPTER_DIR / ADAPTER_WEIGHTS), device=str(self.device))
            set_peft_model_state_dict(self.model, weights, adapter_name=name)
        params = [p for n, p in self.model.named_parameters() if is_adapter_key(n, name)]
        train = view.train
        optimizer = torch.optim.AdamW(params, lr=train.lr, betas=train.adam_betas, weight_decay=train.weight_decay)
        if checkpoint:
            # Only the active adapter's parameters are trainable, and torch's optimizer state dict skips the others.
            self.model.set_adapter(name)
            load_optimizer(self.model, optimizer, Path(checkpoint))
        run_dir = RunDir(view.run_dir)
        self.adapters[name] = _Adapter(view, optimizer, params, run_dir, dict(run_dir.ledger().trained))

    def remove_adapter(self, name: str) -> None:
        """Drop a retired adapter's weights and optimizer state."""
        if self.adapters.pop(name, None) is not None:
            if self.adapters and name in self.model.active_adapters:
                # Hand the active role to a remaining adapter first, or peft picks one itself and warns. Harmless
                # for training: `train` activates its own adapter before each step.
                self.model.set_adapter(next(iter(self.adapters)))
            self.model.delete_adapter(name)

    def train(self, name: str, rollout_id: int, table: pa.Table) -> dict[str, float]:
        """This adapter's optimizer steps on its rollout, once; a repeated call returns its metrics (the driver records
        them in the adapter's ledger)."""
        adapter = self.adapters[name]
        if rollout_id in adapter.trained:
            return adapter.trained[rollout_id]
        torch.manual_seed(train_seed(adapter.config.seed, rollout_id, rank=0))
        config = with_kl_reward_coef(adapter.config, adapter.trained, rollout_id)
        self.model.set_adapter(name)
        self.model.train()
        reference = None
        if config.algo.needs_reference:
            reference = partial(self._base_logprobs, config=config)
        metrics = train_on_rollout(
            self.model,
            adapter.optimizer,
            adapter.params,
            table,
            config,
            self.device,
            self.pad_token_id,
            reference,
        )
        adapter.trained[rollout_id] = metrics
        return metrics

    def _base_logprobs(self, batch, config: RunConfig) -> torch.Tensor:
        with self.model.disable_adapter():
            return batch_logprobs(self.model, batch, config, self.device)

    def adapter_weights(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's PEFT state dict (the keys of adapter_model.safetensors), on the CPU."""
        return {
            k: v.detach().to("cpu", copy=True)
            for k, v in get_peft_model_state_dict(self.model, adapter_name=name).items()
        }

    def adapter_config(self, name: str) -> dict[str, Any]:
        return config_dict(self.model.peft_config[name])

    def save_checkpoint(self, name: str, rollout_id: int, state: dict[str, Any]) -> str:
        """<adapter dir>/checkpoints/<rollout_id>/: `adapter/` (a PEFT directory, written by rank 0), the optimizer
        (through the DCP path every rank takes part in) and the state; a retried save keeps the checkpoint there."""
        adapter = self.adapters[name]

        def write_files(staging: Path) -> None:
            if self.rank == 0:
                self._write_adapter_files(name, staging / ADAPTER_DIR)
            self.model.set_adapter(name)  # as in add_adapter: the optimizer state of the trainable parameters only
            save_optimizer(self.model, adapter.optimizer, staging)

        target = adapter.run_dir.checkpoint(rollout_id)
        return str(write_checkpoint_from_ranks(target, rollout_id, state, self.rank, write_files))

    def _write_adapter_files(self, name: str, target: Path) -> None:
        target.mkdir()
        # A copy: the live config is what the engines compare on each push, and must not change on a save.
        config = {**config_dict(self.model.peft_config[name]), "base_model_name_or_path": self.base_dir}
        (target / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
        save_file(
            {k: v.contiguous() for k, v in self.adapter_weights(name).items()},
            str(target / ADAPTER_WEIGHTS),
            metadata={"format": "pt"},
        )
