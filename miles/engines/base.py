"""The RolloutEngine protocol: what every inference engine (torch, SGLang) offers the controller, and its requests."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file

from miles.config import AdapterConfig, RolloutConfig
from miles.weights.group import TensorSpec, WeightGroup

# What an engine can release of its device memory while a colocated trainer steps, as SGLang's memory saver names it
# (sglang/srt/constants.py). Released weights are dropped, not kept on the host: the push after `resume_memory` of
# "weights" refills them (as slime and miles drive SGLang); the KV cache is rebuilt empty.
KV_CACHE, WEIGHTS = "kv_cache", "weights"
MEMORY_TAGS = (KV_CACHE, WEIGHTS)


def check_memory_tags(tags) -> list[str]:
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"memory tags {unknown}: an engine releases {list(MEMORY_TAGS)}")
    return [tag for tag in MEMORY_TAGS if tag in tags]


class EngineUnavailable(RuntimeError):
    """The engine's server is gone, failing (5xx) or not answering; its health check fails and it gets restarted."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy decoding (the log-probs are then at temperature 1, as SGLang's)
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerateRequest:
    """One sample to generate. Its random draws depend on `seed` only, never on the other requests of a batch,
    so a retried rollout samples the same tokens and one adapter's new weights leave other adapters' samples alone."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None  # LoRA adapter name; None generates with the base weights
    seed: int = 0


@dataclass(frozen=True)
class GenerationProgress:
    """An engine's counters since it started, of finished requests and the tokens they generated, as SGLang counts
    them (`sglang:num_requests_total`, `sglang:generation_tokens_total`): polled while a long batch runs."""

    requests_finished: int = 0
    tokens_generated: int = 0

    def __add__(self, other: GenerationProgress) -> GenerationProgress:
        return GenerationProgress(
            self.requests_finished + other.requests_finished, self.tokens_generated + other.tokens_generated
        )

    def __sub__(self, other: GenerationProgress) -> GenerationProgress:
        return GenerationProgress(
            self.requests_finished - other.requests_finished, self.tokens_generated - other.tokens_generated
        )


@dataclass(frozen=True)
class GenerateResult:
    """`logprobs[i]` is the log-prob of `output_ids[i]` under the temperature-scaled distribution (before top-p),
    and `weight_versions[i]` the version of the weights that generated it (the adapter's for an adapter request):
    a weight push in the middle of a generation changes the version from the next token on."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_versions: list[int]

    def __post_init__(self) -> None:
        if not (len(self.output_ids) == len(self.logprobs) == len(self.weight_versions)):
            raise ValueError(
                f"a generate result needs one log-prob and one weight version per output token: "
                f"{len(self.output_ids)} tokens, {len(self.logprobs)} log-probs, {len(self.weight_versions)} versions"
            )

    @property
    def weight_version(self) -> int:
        """The oldest version any of its tokens came from (what bounds its staleness)."""
        return min(self.weight_versions)


def eos_token_ids(tokenizer) -> tuple[int, ...]:
    """Every end-of-sequence id of the model: the tokenizer's, then those of config.json and generation_config.json
    in the directory the tokenizer came from (an id or a list in each). SGLang stops on all of them whatever a
    request asks, so every engine is given all of them as stop ids and both engines stop alike."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for name in ("config.json", "generation_config.json"):
        path = Path(tokenizer.name_or_path) / name
        if tokenizer.name_or_path and path.is_file():  # a tokenizer built in memory has no directory
            found = json.loads(path.read_text()).get("eos_token_id")
            ids += found if isinstance(found, list) else [found] if found is not None else []
    return tuple(dict.fromkeys(int(i) for i in ids))


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors files."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors files in {directory}")
    return {name: tensor for path in files for name, tensor in load_file(path).items()}


def check_adapters_loaded(requests: list[GenerateRequest], loaded) -> None:
    """Refuse requests that name an adapter not in `loaded`, before any of the batch runs."""
    unknown = sorted({r.adapter for r in requests if r.adapter is not None and r.adapter not in loaded})
    if unknown:
        raise ValueError(f"requests name adapters that are not loaded: {unknown}; loaded: {sorted(loaded)}")


def shared_launch_args(model_dir: str, weight_version: int, rollout: RolloutConfig, dtype: str) -> dict[str, Any]:
    """The launch arguments every engine takes: the model and its version, the device and the dtype it serves,
    and how requests are scheduled and paused for a push."""
    return dict(
        model_dir=model_dir,
        weight_version=weight_version,
        device=rollout.device,
        dtype=dtype,
        max_running_requests=rollout.max_running_requests,
        pause_generation_mode=rollout.pause_generation_mode,
    )


class RolloutEngine(Protocol):
    """What the InferenceController and the weight transports ask of an engine class: how to launch it from the run's
    config, the calls on a running engine (each in its Ray actor), and the weight transports it takes, each with its
    load call (miles.rollout.weight_transport). An engine owns its refit: a load pauses the generations in flight,
    loads, and continues them on the new weights (SGLang's pause / begin / load / end / continue; the TorchEngine
    between two decode steps); `health` is its own liveness check."""

    weight_transports: tuple[
        str, ...
    ]  # the transports it takes (object_store, disk, tensor, distributed), its default first
    distributed_load_format: str | None  # how a broadcast bucket arrives: FLATTENED, or None for tensor by tensor

    @classmethod
    def launch_args(
        cls,
        model_dir: str,
        weight_version: int,
        rollout: RolloutConfig,
        adapters: Sequence[AdapterConfig],
        colocated_trainer_bytes: float | None = None,
    ) -> dict[str, Any]:
        """The constructor's keyword arguments for an engine of `rollout` serving `adapters`; colocated, beside a
        trainer rank that keeps `colocated_trainer_bytes` on the GPU between steps (miles.cluster.memory_budget)."""
        ...

    @classmethod
    def ranks(cls, rollout: RolloutConfig) -> int:
        """The devices (and weight-update group ranks) one engine takes."""
        ...

    @classmethod
    def served_dtype(cls, model_dir: str, rollout: RolloutConfig) -> str:
        """The dtype it serves a model directory's weights in (rollout.dtype; auto: the model's own, or the engine's
        rule): what a push casts them to on the way."""
        ...

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]: ...

    def progress(self) -> GenerationProgress:
        """Requests finished and tokens they generated since the engine started (answered while it generates)."""
        ...

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Transport object_store: the tensors, handed over through Ray's object store."""
        ...

    def update_weights_from_disk(self, directory: str, version: int) -> None:
        """Transport disk: a model directory the trainer wrote."""
        ...

    def update_weights_from_distributed(
        self,
        group: WeightGroup,
        rank_offset: int,
        buckets: list[list[TensorSpec]],
        version: int,
        load_format: str | None = None,
    ) -> None:
        """Transport distributed: a broadcast over a weight-update group."""
        ...

    def update_weights_from_tensor(self, payloads: list[str], version: int, last: bool = True) -> None:
        """Transport tensor: SGLang `/update_weights_from_tensor` payloads, a flattened bucket each
        (miles.weights.payload). A push may come in parts, in order, its last part with `last`: the first part of a
        version pauses generation, the last loads the version and continues (a part of another version first ends
        the push that version left unfinished)."""
        ...

    def close_weight_update(self) -> None:
        """End a push of several parts that stopped before its last: generation continues on the weights as they
        are (partly loaded: the controller sends the next push whole). Nothing when no push is open."""
        ...

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """The log-prob of each of `token_ids[1:]` given the tokens before it, under the weights served now (at
        temperature 1, no adapter): what the push check compares with the trainer's (miles.weights.check)."""
        ...

    def weights_checksum(self) -> str | None:
        """A digest of every weight served now, which changes when any of them does (miles.weights.check); None when the
        engine cannot tell."""
        ...

    def release_memory(self, tags: Sequence[str]) -> None:
        """Free the device memory of `tags` (MEMORY_TAGS) for the trainer on the same GPU; only while no request is in
        flight. Until `resume_memory` of the same tags the engine refuses to generate; released weights come back
        empty, for a push to fill."""
        ...

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Take back the device memory of released `tags` (a tag not released is left as it is)."""
        ...

    def load_adapter(self, name: str, named_tensors: dict[str, torch.Tensor], config: dict, version: int) -> None: ...

    def unload_adapter(self, name: str) -> None: ...

    def weight_version(self) -> int: ...

    def adapter_versions(self) -> dict[str, int]: ...

    def health(self) -> bool: ...

    def shutdown(self) -> None: ...
