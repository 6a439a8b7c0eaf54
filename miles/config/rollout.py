"""The rollout section: the engines that generate, how they sample, and how weights reach them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from miles.config.base import CHANGES_FREELY, IMPORT_PATH, LAUNCH, Section, mid_run
from miles.registry import check_engine_name


class SGLangConfig(Section):
    """SGLang servers (`rollout.engine: sglang`), one per engine actor, driven over their HTTP API."""

    python: str | None = Field(
        None,
        json_schema_extra=LAUNCH,
        description="the Python of SGLang's environment (SGLang pins its own torch and transformers); unset: this one",
    )
    server_module: str = Field(
        "sglang.launch_server",
        json_schema_extra=LAUNCH,
        description="module started as `<python> -m <module> --model-path ...`",
    )
    tp_size: int = Field(1, gt=0, description="tensor-parallel GPUs per server")
    mem_fraction_static: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="GPU memory share for weights and KV cache; unset: SGLang's choice, or colocated, what the trainer "
        "rank leaves (miles.cluster.memory_budget)",
    )
    max_loras_per_batch: int = Field(8, gt=0, description="adapters (the base counts as one) in one batch")
    extra_args: list[str] = Field(
        default_factory=list,
        json_schema_extra=LAUNCH,
        description="further launch_server flags, e.g. ['--enable-torch-compile']",
    )
    attention_backend: str | None = Field(
        None,
        description="--attention-backend; unset: SGLang's choice on a GPU, torch_native on a CPU (SGLang's CPU default "
        "needs a CPU build of its kernel package, which is not published)",
    )
    max_total_tokens: int | None = Field(
        None,
        gt=0,
        description="--max-total-tokens, the KV cache's size in tokens; unset: SGLang sizes it from "
        "mem_fraction_static on a GPU, and 8192 on a CPU (its own choice there takes most of the machine's memory)",
    )
    startup_timeout_s: float = Field(
        900.0, gt=0, description="a server not answering /health_generate by then fails to start"
    )
    health_timeout_s: float = Field(20.0, gt=0, description="a /health_generate slower than this marks the server dead")
    deterministic_inference: bool = Field(
        True,
        description="launch with --enable-deterministic-inference: SGLang honours each request's sampling_seed only "
        "then, so a retried rollout samples the same tokens; false: faster kernels, retries resample. SGLang allows "
        "it with the GPU attention backends only: with torch_native (the CPU's) the server starts without it and says "
        "so in its log",
    )


class RolloutConfig(Section):
    engine: str = Field(
        "torch",
        json_schema_extra=IMPORT_PATH | CHANGES_FREELY,
        description="torch: TorchEngine actors; sglang: SGLang servers (make install-gpu); or 'pkg.mod:Class' "
        "implementing miles.engines.base.RolloutEngine",
    )
    num_engines: int = Field(1, gt=0, json_schema_extra=CHANGES_FREELY)
    rollout_batch_size: int = Field(64, gt=0, description="prompts per rollout")
    n_samples_per_prompt: int = Field(8, gt=0)
    temperature: float = Field(
        1.0, gt=0, description="the sampling temperature", json_schema_extra=mid_run("temperature")
    )
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int | None = Field(
        None, gt=0, description="tokens a response may take; unset: the preset's (4 on a built-in task, else 1024)"
    )
    num_threads: int = Field(
        2, gt=0, description="torch threads of each engine actor", json_schema_extra=CHANGES_FREELY
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="torch device of the engines: cpu or cuda",
        json_schema_extra=CHANGES_FREELY,
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="the dtype the engines serve the weights in; auto: the model's own (config.json), except that "
        "the torch engine on a CPU serves float32 (the trainer's master weights; CPU bfloat16 matmuls are slow)",
        json_schema_extra=CHANGES_FREELY,
    )
    engine_timeout_s: float = Field(
        600.0,
        gt=0,
        description="an engine that has not answered a batch or a push within this time is health-checked, and "
        "restarted if it fails (a busy, healthy engine is waited for, so a long generation is not a hang)",
        json_schema_extra=CHANGES_FREELY,
    )
    max_generate_rounds: int = Field(
        1, gt=0, description="with algo.dynamic_sampling: rounds of rollout_batch_size prompts a rollout may draw"
    )
    max_weight_staleness: int | None = Field(
        None, ge=0, description="get drops groups generated more than this many weight versions behind the trainer"
    )
    max_running_requests: int | None = Field(
        None,
        gt=0,
        description="requests an engine decodes at once; a finished one's slot goes to a waiting request at the next "
        "step (continuous batching); unset: every request that has arrived",
        json_schema_extra=CHANGES_FREELY,
    )
    pause_generation_mode: Literal["retract", "in_place"] = Field(
        "retract",
        description="how a weight push meets the generations in flight: retract (their KV cache is recomputed on the "
        "new weights) or in_place (kept); either way they continue on the new weights",
        json_schema_extra=CHANGES_FREELY,
    )
    max_rollouts_in_flight: int = Field(
        2, gt=0, description="rl-fully-async: rollouts generated ahead of the one the trainer takes next"
    )
    weight_transport: Literal["object_store", "disk", "tensor", "distributed"] | None = Field(
        None,
        description="how pushed weights reach the engines: object_store (torch engines), disk (a model directory "
        "under the run directory), tensor (SGLang's update_weights_from_tensor: CUDA IPC handles to the trainer's "
        "memory, for a server on the trainer's GPU), distributed (a broadcast from the trainer's rank 0); unset: the "
        "engine's own choice (object_store for torch, disk for sglang)",
        json_schema_extra=CHANGES_FREELY,
    )
    colocate: bool = Field(
        False,
        description="engine i shares trainer rank i's GPU (one Ray placement-group bundle per pair; needs "
        "rollout.num_engines == train.num_workers, both on cuda, one GPU per engine); false: every engine takes GPUs "
        "of its own (rollout.sglang.tp_size), apart from the trainer's",
        json_schema_extra=CHANGES_FREELY,
    )
    push_check_atol: float = Field(
        0.15,
        gt=0,
        description="a weight push has landed when each engine's log-probs of the model's own greedy 16-token "
        "sequence are within this of the trainer's (mean absolute difference per token; a real bf16 model served "
        "by SGLang differs by about 0.035) and the engine's weights checksum moved with the trainer's "
        "(miles.weights.check)",
        json_schema_extra=CHANGES_FREELY,
    )
    sglang: SGLangConfig = Field(SGLangConfig(), json_schema_extra=CHANGES_FREELY)
    env: str | None = Field(
        None,
        json_schema_extra=IMPORT_PATH,
        description="multi-turn episodes in this environment (built-in: calculator; or 'pkg.mod:Class'), rewarded "
        "by it instead of data.reward; unset: one completion per prompt",
    )
    max_turns: int = Field(4, gt=0, description="with rollout.env: model turns an episode may take")
    max_episode_tokens: int | None = Field(
        None, gt=0, description="with rollout.env: tokens after the prompt (model and environment); unset: the context"
    )
    env_step_timeout_s: float = Field(
        30.0, gt=0, description="with rollout.env: an environment call that takes longer fails its episode"
    )
    generate_fn: str | None = Field(
        None,
        json_schema_extra=IMPORT_PATH,
        description="'pkg.mod:fn' producing the samples: fn(client, samples) -> list[SampleRecord] "
        "(miles.rollout.generation); unset: one completion per prompt, or episodes with rollout.env",
    )

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        return check_engine_name(name)

    @property
    def max_model_tokens(self) -> int:
        """The most tokens the model generates in one sample: max_new_tokens, or for an episode max_turns of them
        (within max_episode_tokens). The horizon of the seq_mean_token_sum_norm aggregation."""
        if self.env is None:
            return self.max_new_tokens
        episode = self.max_turns * self.max_new_tokens
        return episode if self.max_episode_tokens is None else min(episode, self.max_episode_tokens)
