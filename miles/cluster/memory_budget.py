"""What a run keeps on each GPU, from its config and its model's config.json (nothing is loaded): the answer to "will
this fit", which `miles plan` prints beside the placement and refuses on.

Conventions, in bytes, for a model of P parameters, L layers of width H, trained by W ranks (FSDP2 shards every
state over them; one unsharded rank holds it whole):
- trainer states: float32 master weights 4P/W, float32 gradients 4P/W, AdamW's two float32 moments 8P/W, and where
  the KL terms need it the float32 reference policy 4P/W. With `train.param_dtype=bfloat16` FSDP2 gathers each layer
  in bf16 for compute: two layers at a time (one prefetched), 2 * 2P/L.
- activations of one micro-batch of T = `train.max_tokens_per_micro_batch` tokens: a whole layer's are 34*T*H bytes
  in 16-bit (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 1, with
  the attention scores never stored, as FlashAttention and SDPA compute them; 32-bit doubles it). Without
  activation checkpointing every layer keeps them; with it each layer keeps only its input (2*T*H in 16-bit) and one
  layer is recomputed whole at a time. The output head's float32 logits run `train.logits_chunk_mb` at a time, kept
  with their gradient: 2 chunks.
- an SGLang engine takes `rollout.sglang.mem_fraction_static` of its GPU for its weights (P bytes in the served
  dtype, split over its tensor-parallel ranks) and its KV cache (the rest of that share). Unset, SGLang sizes it
  from the free memory it sees at start, which only an engine on a GPU of its own may do; a colocated engine is
  given what its trainer rank leaves (`colocated_engine_share`).
- colocated, the engine releases its weights and KV cache while its trainer rank steps (miles.engines.base
  MEMORY_TAGS), so the GPU holds at most one of: the trainer's step (every part above), or the trainer's resident
  states (all but the activations and the gathered layers) beside the engine.
Not counted: CUDA's context and allocator slack, NCCL's buffers, temporary tensors of the loss; `HEADROOM` of each
GPU is left for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from miles.config import RunConfig

GIB = 2**30
HEADROOM = 0.1  # of each GPU, for what is not counted
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACTIVATION_BYTES_PER_TOKEN_WIDTH = 34  # per layer, 16-bit (Korthikanti et al. 2022)


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    layers: int
    hidden: int
    dtype: str  # the model's own (config.json), what a served `auto` dtype is

    @classmethod
    def read(cls, model_dir: Path) -> ModelShape:
        """From config.json alone: the model is built on the meta device, so that tied and untied heads count right."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        parameters = sum(p.numel() for p in model.parameters())  # a tied parameter is listed once
        dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
        return cls(parameters, config.num_hidden_layers, config.hidden_size, dtype.removeprefix("torch."))


@dataclass
class GPUBudget:
    """What one GPU holds: parts by name, in bytes."""

    name: str
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self, gpu_bytes: float) -> str:
        parts = ", ".join(f"{name} {value / GIB:.1f}" for name, value in self.parts.items())
        return f"{self.name}: {self.total / GIB:.1f} of {gpu_bytes / GIB:.0f} GiB ({parts})"


def trainer_parts(config: RunConfig, model: ModelShape) -> dict[str, float]:
    train = config.train
    ranks = train.num_workers
    p = model.parameters
    parts = {
        "master weights": 4 * p / ranks,
        "gradients": 4 * p / ranks,
        "Adam moments": 8 * p / ranks,
    }
    if config.algo.needs_reference:
        parts["reference"] = 4 * p / ranks
    compute = BYTES[train.param_dtype]
    if train.param_dtype != "float32":
        parts["gathered layers"] = 2 * compute * p / model.layers
    tokens = train.max_tokens_per_micro_batch
    if tokens is not None:
        layer = ACTIVATION_BYTES_PER_TOKEN_WIDTH * tokens * model.hidden * compute / 2
        kept = (
            model.layers * tokens * model.hidden * compute + layer
            if train.gradient_checkpointing
            else model.layers * layer
        )
        parts["activations"] = kept + 2 * train.logits_chunk_mb * 2**20
    return parts


STEP_ONLY = ("activations", "gathered layers")  # what a trainer rank frees when its step ends


def resident_bytes(trainer: dict[str, float]) -> float:
    """What a trainer rank keeps on its GPU between steps, while its colocated engine generates."""
    return sum(value for name, value in trainer.items() if name not in STEP_ONLY)


def colocated_engine_share(trainer_resident_bytes: float, gpu_bytes: float) -> float:
    """The share of its GPU a colocated engine takes for its weights and KV cache (SGLang's mem_fraction_static):
    what the trainer rank beside it leaves of the usable memory."""
    share = 1 - HEADROOM - trainer_resident_bytes / gpu_bytes
    if share <= 0:
        raise ValueError(
            f"the trainer rank keeps {trainer_resident_bytes / GIB:.1f} GiB of its {gpu_bytes / GIB:.0f} GiB GPU between "
            f"steps: no room for a colocated engine; raise train.num_workers or set rollout.colocate=false"
        )
    return math.floor(share * 1000) / 1000  # down: rounded up, the GPU would hold more than it can


def engine_parts(config: RunConfig, model: ModelShape, served_dtype: str, gpu_bytes: float) -> dict[str, float]:
    rollout = config.rollout
    tp = rollout.sglang.tp_size if rollout.engine == "sglang" else 1
    weights = BYTES[served_dtype] * model.parameters / tp
    share = rollout.sglang.mem_fraction_static if rollout.engine == "sglang" else None
    if share is None and rollout.engine == "sglang" and rollout.colocate:
        share = colocated_engine_share(resident_bytes(trainer_parts(config, model)), gpu_bytes)
    if share is None:
        return {"engine weights": weights}
    return {"engine weights": weights, "KV cache": share * gpu_bytes - weights}


def budget(config: RunConfig, model: ModelShape, served_dtype: str, gpu_gib: float) -> list[GPUBudget]:
    """The GPUs of one kind each: a trainer rank's and an engine's, or colocated, their shared GPU in each phase (the
    trainer stepping with its engine released, the engine generating beside the trainer's resident states); raises
    ValueError naming the GPU and its parts when one cannot fit. `served_dtype`: the engine's (its `served_dtype`)."""
    gpu_bytes = gpu_gib * GIB
    trainer = GPUBudget("trainer rank", trainer_parts(config, model))
    parts = engine_parts(config, model, served_dtype, gpu_bytes)
    engine = GPUBudget("engine" if "KV cache" in parts else "engine (and the KV cache SGLang sizes at start)", parts)
    if config.rollout.colocate:
        resident = {name: value for name, value in trainer.parts.items() if name not in STEP_ONLY}
        gpus = [
            GPUBudget("trainer rank stepping (its engine released)", trainer.parts),
            GPUBudget("engine generating beside its trainer rank", {**resident, **engine.parts}),
        ]
    else:
        gpus = [trainer, engine]
    usable = (1 - HEADROOM) * gpu_bytes
    for gpu in gpus:
        if gpu.parts.get("KV cache", 1) <= 0:
            raise ValueError(
                f"rollout.sglang.mem_fraction_static={config.rollout.sglang.mem_fraction_static} of a {gpu_gib:g} GiB "
                f"GPU does not hold the engine's weights ({gpu.parts['engine weights'] / GIB:.1f} GiB): no room for a "
                f"KV cache"
            )
        if gpu.total > usable:
            raise ValueError(
                f"{gpu.describe(gpu_bytes)} does not fit in {1 - HEADROOM:.0%} of the GPU: raise train.num_workers, set "
                f"train.param_dtype=bfloat16, train.gradient_checkpointing=true or a smaller "
                f"train.max_tokens_per_micro_batch"
                + (", or lower rollout.sglang.mem_fraction_static" if config.rollout.colocate else "")
            )
    return gpus
