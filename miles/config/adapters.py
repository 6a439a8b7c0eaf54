"""The multi-LoRA flow's sections: its adapters and the tenants service."""

from __future__ import annotations

from pydantic import Field, model_validator

from miles.config.base import CHANGES_FREELY, Section
from miles.config.data import DataConfig, EvalConfig

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterConfig(Section):
    """One LoRA adapter of the multi-LoRA flow: its own data, reward, optimizer and step budget on the shared base."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,39}$", description="lowercase letters, digits and dashes")
    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGET_MODULES), min_length=1)
    data: DataConfig = DataConfig()
    lr: float = Field(2e-3, gt=0)
    num_steps: int = Field(
        100, gt=0, description="rollouts this adapter trains on before it retires", json_schema_extra=CHANGES_FREELY
    )
    rollout_batch_size: int = Field(32, gt=0, description="prompts per rollout")
    n_samples_per_prompt: int = Field(8, gt=0)
    global_batch_size: int | None = Field(
        None, gt=0, description="samples per optimizer step; unset: the whole rollout"
    )
    eval: EvalConfig = Field(
        EvalConfig(),
        description="this adapter's evaluation (unset: as eval for its data)",
        json_schema_extra=CHANGES_FREELY,
    )
    trainer_group: str = Field(
        "main",
        pattern=r"^[a-z][a-z0-9-]{0,39}$",
        description="the trainer group that trains it (train.num_workers workers of its own); the adapters of a "
        "group take turns on it, groups train at the same time",
        json_schema_extra=CHANGES_FREELY,
    )

    @model_validator(mode="after")
    def _batch_shape(self) -> AdapterConfig:
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if self.global_batch_size is not None and samples % self.global_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must divide "
                f"rollout_batch_size x n_samples_per_prompt ({samples})"
            )
        return self


class TenantsConfig(Section):
    """The multi-LoRA run as a service: adapters submitted while it runs (`miles tenant submit`) join it."""

    idle_timeout_s: float | None = Field(
        0.0,
        ge=0,
        description="with every adapter done, wait this long for a new tenant before the run ends; "
        "unset: until the run is cancelled",
    )


def embedded_adapters() -> list[AdapterConfig]:
    """The multi-LoRA default on the embedded model: one adapter per built-in task, each its own reward signal.

    They keep AdapterConfig's lr (2e-3): subtraction learns near the edge of stability (at 6e-3, or rank 32 at 3e-3,
    it unlearns; at 3e-3 one flow run gained 0.012 where others gained 0.044 to 0.059), and addition gains as much
    at 2e-3 as at 3e-3."""
    return [
        AdapterConfig(
            name=task,
            data=DataConfig(task=task),
            num_steps=150,
            rollout_batch_size=64,
            n_samples_per_prompt=8,
            global_batch_size=256,
        )
        for task in ("addition", "subtraction")
    ]
