"""The trainer groups: the train section (the policy's) and the critic section (PPO's value model)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from miles.config.base import CHANGES_FREELY, FILE_PATH, Section, mid_run


class TrainConfig(Section):
    lr: float | None = Field(
        None,
        gt=0,
        description="the optimizer's learning rate; unset: the preset's (5e-4 on a built-in task, else 1e-6)",
        json_schema_extra=mid_run("lr"),
    )
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] | None = Field(
        None, description="unset: the preset's ((0.9, 0.98) on a built-in task, else torch's (0.9, 0.999))"
    )
    grad_clip: float = Field(1.0, gt=0)
    global_batch_size: int = Field(256, gt=0, description="samples per optimizer step")
    micro_batch_size: int = Field(
        256, gt=0, description="samples per forward/backward, at most", json_schema_extra=CHANGES_FREELY
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="padded tokens (samples x the longest of them) per forward/backward, at most: micro-batches of "
        "short samples take more of them (a longer sample goes alone); unset: the preset's (none on a built-in task: "
        "micro_batch_size samples each; else 8192)",
        json_schema_extra=CHANGES_FREELY,
    )
    logits_chunk_mb: float = Field(
        64.0,
        gt=0,
        description="the output head runs this many MiB of float32 logits at a time (positions x vocabulary), so "
        "that a micro-batch's memory does not grow with its length times the vocabulary",
        json_schema_extra=CHANGES_FREELY,
    )
    num_passes: int = Field(1, gt=0, description="passes over each rollout")
    num_threads: int = Field(2, gt=0, description="torch threads of the train actor", json_schema_extra=CHANGES_FREELY)
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="torch device of the trainer: cpu or cuda",
        json_schema_extra=CHANGES_FREELY,
    )
    num_workers: int = Field(
        1,
        gt=0,
        description="trainer workers: Ray actors in one torch.distributed group",
        json_schema_extra=CHANGES_FREELY,
    )
    sharding: Literal["none", "fsdp"] | None = Field(
        None,
        description="fsdp: FSDP2 per decoder layer plus the root; none: one unsharded process; "
        "unset: fsdp when num_workers > 1 or param_dtype is not float32",
        json_schema_extra=CHANGES_FREELY,
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="compute dtype of the sharded model; gradients are reduced and stepped in float32"
    )
    gradient_checkpointing: bool | None = Field(
        None,
        description="recompute each layer's activations in the backward; unset: the preset's (off on a built-in "
        "task, on for own data)",
        json_schema_extra=CHANGES_FREELY,
    )
    weight_bucket_mb: float = Field(
        512.0,
        gt=0,
        description="full tensors gathered at a time when weights leave a sharded trainer",
        json_schema_extra=CHANGES_FREELY,
    )
    placement: Literal["pack", "spread"] = Field(
        "pack",
        description="trainer workers on as few nodes as possible, or across nodes",
        json_schema_extra=CHANGES_FREELY,
    )

    @model_validator(mode="after")
    def _parallelism(self) -> TrainConfig:
        if self.sharding == "none" and self.num_workers > 1:
            raise ValueError(f"train.sharding=none runs one worker; num_workers={self.num_workers} needs fsdp")
        if self.sharding == "none" and self.param_dtype != "float32":
            raise ValueError(f"train.param_dtype={self.param_dtype} is FSDP2's mixed precision: needs sharding=fsdp")
        return self

    @property
    def sharded(self) -> bool:
        """FSDP2 over a process group (of one worker, for mixed precision alone)."""
        if self.sharding is not None:
            return self.sharding == "fsdp"
        return self.num_workers > 1 or self.param_dtype != "float32"


class CriticConfig(Section):
    """PPO's value model (algo.advantage_estimator=gae): a trainer group of its own beside the policy's, with the
    policy trainer's settings (device, sharding, dtype, batch sizes, passes) unless set here."""

    model_path: str | None = Field(
        None,
        json_schema_extra=FILE_PATH,
        description="a Hugging Face model directory to start the critic from; unset: the policy's starting model. "
        "A causal LM gets a new value head (one output per token)",
    )
    lr: float | None = Field(None, gt=0, description="unset: the preset's (2e-3 on a built-in task, else 1e-5)")
    cliprange_value: float | None = Field(
        0.5, gt=0, description="each value stays within this of the one the rollout was estimated with; unset: off"
    )
    warmup_rollouts: int = Field(
        0, ge=0, description="the first N rollouts train the critic only; the policy takes no step on them"
    )
    num_workers: int = Field(
        1,
        gt=0,
        description="critic workers: Ray actors in one torch.distributed group",
        json_schema_extra=CHANGES_FREELY,
    )
