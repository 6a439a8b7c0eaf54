"""The model section: a Hugging Face directory, or the embedded tiny model and its warm-up."""

from __future__ import annotations

from pydantic import Field

from miles.config.base import FILE_PATH, Section


class TinyModelConfig(Section):
    """Shape of the embedded Llama model built when `model.path` is not set."""

    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    intermediate_size: int = Field(512, gt=0)
    max_position_embeddings: int = Field(32, gt=0)


class WarmupConfig(Section):
    """Supervised warm-up of the embedded model, so that RL starts from a policy with some signal.

    Greedy accuracy climbs from 0.2 to 0.3 within about 50 steps; a frequent check on many prompts stops every
    machine at about the same model (one check every 50 steps on 200 prompts stopped some at 0.17, others at 0.3,
    by float rounding, and RL from the weaker start learned too slowly to pass the learning bars reliably)."""

    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(128, gt=0)
    target_accuracy: float = Field(0.3, ge=0, le=1)
    max_steps: int = Field(1500, ge=0)
    eval_every: int = Field(10, gt=0)
    eval_prompts: int = Field(500, gt=0)


class ModelConfig(Section):
    path: str | None = Field(
        None,
        json_schema_extra=FILE_PATH,
        description="Hugging Face model directory; unset builds the embedded tiny model",
    )
    tiny: TinyModelConfig = TinyModelConfig()
    warmup: WarmupConfig = WarmupConfig()
