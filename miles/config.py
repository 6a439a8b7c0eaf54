"""Run configuration: one pydantic model that is the flow parameter, the YAML file format and the CLI target."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from miles.registry import check_algorithm_name, check_engine_name
from miles.run_dir import RunDir
from miles.seeds import adapter_run_seed

# Marks a field that may name the user's code as 'pkg.mod:name' (RunConfig.import_paths lists them).
IMPORT_PATH = {"import_path": True}
# Marks a field that chooses a program a worker starts (RunConfig.launch_settings lists them).
LAUNCH = {"launch": True}
# Marks a field that names a file or directory the run reads or writes (RunConfig.file_paths lists them).
FILE_PATH = {"file_path": True}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def marked(self, marker: dict[str, bool], prefix: str = "") -> dict[str, Any]:
        """Every field marked `marker` (in sections, and in lists of sections), by its dotted name, with its value."""
        found = {}
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            field = f"{prefix}{name}"
            if isinstance(value, _Section):
                found |= value.marked(marker, f"{field}.")
            elif isinstance(value, list) and value and isinstance(value[0], _Section):
                for index, item in enumerate(value):
                    found |= item.marked(marker, f"{field}.{index}.")
            elif info.json_schema_extra == marker:
                found[field] = value
        return found

    def import_paths(self) -> dict[str, str]:
        """Every 'pkg.mod:name' the config names, by field: {'data.reward': 'my_rewards:score', ...}."""
        return {f: v for f, v in self.marked(IMPORT_PATH).items() if isinstance(v, str) and ":" in v}

    def launch_settings(self) -> dict[str, Any]:
        """Every field that chooses a program a worker starts, with its value: {'rollout.sglang.python': ..., ...}."""
        return self.marked(LAUNCH)

    def file_paths(self) -> dict[str, str]:
        """Every file or directory the config names, by field: {'run_dir': ..., 'data.path': ..., ...}."""
        return {f: v for f, v in self.marked(FILE_PATH).items() if v is not None}


class TinyModelConfig(_Section):
    """Shape of the embedded Llama model built when `model.path` is not set."""

    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    intermediate_size: int = Field(512, gt=0)
    max_position_embeddings: int = Field(32, gt=0)


class WarmupConfig(_Section):
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


class ModelConfig(_Section):
    path: str | None = Field(
        None,
        json_schema_extra=FILE_PATH,
        description="Hugging Face model directory; unset builds the embedded tiny model",
    )
    tiny: TinyModelConfig = TinyModelConfig()
    warmup: WarmupConfig = WarmupConfig()


class DataConfig(_Section):
    task: str | None = Field("addition", description="built-in task (see miles.envs); unset when `path` is given")
    path: str | None = Field(
        None,
        json_schema_extra=FILE_PATH,
        description="prompt data: a .jsonl, .parquet or .arrow file, a directory saved by Hugging Face datasets, "
        "or a directory or glob of parquet shards",
    )
    split: str | None = Field(None, description="the split of a saved DatasetDict or of sharded data; unset: train")
    prompt_key: str = Field("prompt", description="prompt column: a string, or chat messages [{role, content}, ...]")
    apply_chat_template: bool | None = Field(
        None,
        description="format prompts with the tokenizer's chat template (add_generation_prompt); unset: chat "
        "messages are, strings are not",
    )
    system_prompt: str | None = Field(None, description="a system message put before each templated prompt")
    label_key: str | None = Field(
        "label", description="label column; null for data without labels (a reward that needs none)"
    )
    shuffle: bool = True
    reward: str = Field(
        "exact_match",
        json_schema_extra=IMPORT_PATH,
        description="exact_match, digit_match, math (math-verify), gsm8k, judge (a generative judge: the judge "
        "section), reward_model (the reward_model section), or an import path 'pkg.mod:name' of a reward function "
        "(plain or async) or of an object with score_batch",
    )
    reward_timeout_s: float = Field(
        30.0, gt=0, description="a reward call slower than this fails its samples (stored as failed, not trained on)"
    )
    reward_concurrency: int = Field(16, gt=0, description="per-sample reward calls in flight at once")

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.task is None) == (self.path is None):
            raise ValueError("set exactly one of data.task and data.path")
        return self


class EvalDatasetConfig(DataConfig):
    """One evaluation data set: data as for training (a built-in task or a path, its columns, template and reward),
    how it is sampled, and how much of it is used."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,39}$", description="lowercase letters, digits and dashes")
    task: str | None = Field(None, description="built-in task (see miles.envs); unset when `path` is given")
    n_samples_per_prompt: int = Field(1, gt=0, description="samples per prompt: pass@k is reported for k up to this")
    temperature: float = Field(0.0, ge=0, description="0: greedy decoding")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int | None = Field(None, gt=0, description="unset: rollout.max_new_tokens")
    max_prompts: int | None = Field(
        None,
        gt=0,
        description="evaluate on this many prompts (a seeded sample when `shuffle`, else the first); unset: all",
    )
    pass_threshold: float = Field(1.0, description="a sample passes (for pass@k) when its reward is at least this")

    @model_validator(mode="after")
    def _greedy_once(self) -> EvalDatasetConfig:
        if self.temperature == 0 and self.n_samples_per_prompt > 1:
            raise ValueError(
                f"temperature 0 decodes greedily: the {self.n_samples_per_prompt} samples of a prompt would be alike; "
                "set n_samples_per_prompt=1 or a temperature above 0"
            )
        return self


class EvalConfig(_Section):
    """Evaluation during training, on the engines holding the current weights. The evaluation at rollout N uses
    weight version N (trained on rollouts 0..N-1: the weights that generate rollout N in the sync flow)."""

    interval: int | None = Field(
        None, gt=0, description="evaluate every N rollouts; unset: only before training and at the end"
    )
    before_training: bool = Field(True, description="evaluate the starting weights (rollout 0)")
    datasets: list[EvalDatasetConfig] | None = Field(
        None,
        description="unset: for a built-in data.task, 200 of its prompts, greedy; for data.path, none; [] turns "
        "evaluation off",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> EvalConfig:
        names = [dataset.name for dataset in self.datasets or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"eval.datasets: names must be unique; repeated: {repeated}")
        return self


DEFAULT_EVAL_PROMPTS = 200


class SGLangConfig(_Section):
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
        "rank leaves (miles.memory_budget)",
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


class LoggingConfig(_Section):
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        description="experiment trackers, each an optional extra (pip install 'miles-flow[tensorboard]', ...)",
    )
    project: str = Field("miles-flow", description="the MLflow experiment and the W&B project")
    events: bool = Field(True, description="a flow emits Prefect events of its iterations, checkpoints and alerts")
    lineage: bool = Field(
        True, description="each checkpoint records what made it: rollouts (sha256), data rows, config, code version"
    )


class AlertsConfig(_Section):
    """What a run's iteration records are watched for (miles.alerts); a flow emits an event for each alert, which the
    shipped automations act on (docs/guides/control.md, "Events and automations")."""

    failed_reward_fraction: float = Field(
        0.5, gt=0, le=1, description="an iteration is unhealthy when the reward failed on this share of its samples"
    )
    reward_collapse_window: int = Field(
        5, gt=0, description="iterations averaged: the latest window's mean reward against the best window's"
    )
    reward_collapse_drop: float = Field(
        0.5, gt=0, le=1, description="a collapse: the latest window's mean is below (1 - this) x the best window's"
    )
    stall_factor: float = Field(
        5.0,
        gt=1,
        description="a run is stalled when no iteration has finished for this many times its median iteration time",
    )
    min_stall_s: float = Field(
        30.0, ge=10, description="the shortest time without an iteration that counts as stalled (Prefect's least: 10)"
    )


class RolloutConfig(_Section):
    engine: str = Field(
        "torch",
        json_schema_extra=IMPORT_PATH,
        description="torch: TorchEngine actors; sglang: SGLang servers (make install-gpu); or 'pkg.mod:Class' "
        "implementing miles.engines.base.RolloutEngine",
    )
    num_engines: int = Field(1, gt=0)
    rollout_batch_size: int = Field(64, gt=0, description="prompts per rollout")
    n_samples_per_prompt: int = Field(8, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int | None = Field(
        None, gt=0, description="tokens a response may take; unset: the preset's (4 on a built-in task, else 1024)"
    )
    num_threads: int = Field(2, gt=0, description="torch threads of each engine actor")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="torch device of the engines: cpu or cuda")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="the dtype the engines serve the weights in; auto: the model's own (config.json), except that "
        "the torch engine on a CPU serves float32 (the trainer's master weights; CPU bfloat16 matmuls are slow)",
    )
    engine_timeout_s: float = Field(
        600.0,
        gt=0,
        description="an engine that has not answered a batch or a push within this time is health-checked, and "
        "restarted if it fails (a busy, healthy engine is waited for, so a long generation is not a hang)",
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
    )
    pause_generation_mode: Literal["retract", "in_place"] = Field(
        "retract",
        description="how a weight push meets the generations in flight: retract (their KV cache is recomputed on the "
        "new weights) or in_place (kept); either way they continue on the new weights",
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
    )
    colocate: bool = Field(
        False,
        description="engine i shares trainer rank i's GPU (one Ray placement-group bundle per pair; needs "
        "rollout.num_engines == train.num_workers, both on cuda, one GPU per engine); false: every engine takes GPUs "
        "of its own (rollout.sglang.tp_size), apart from the trainer's",
    )
    push_check_atol: float = Field(
        0.15,
        gt=0,
        description="a weight push has landed when each engine's log-probs of the model's own greedy 16-token "
        "sequence are within this of the trainer's (mean absolute difference per token; a real bf16 model served "
        "by SGLang differs by about 0.035) and the engine's weights checksum moved with the trainer's "
        "(miles.weight_check)",
    )
    sglang: SGLangConfig = SGLangConfig()
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


class AlgoConfig(_Section):
    """The RL algorithm, by name (docs/algorithms.md: each option, its formula and its paper)."""

    advantage_estimator: str = Field(
        "grpo",
        json_schema_extra=IMPORT_PATH,
        description="grpo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_sample, "
        "reinforce_plus_plus_baseline, gpg, opo, remax (a greedy response per prompt as the baseline), gae (PPO's, "
        "with a critic: the critic section), or 'pkg.mod:fn'",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="gae: the discount per token")
    lam: float = Field(1.0, ge=0, le=1, description="gae: lambda, the bias/variance trade-off of the estimate")
    policy_loss: str = Field(
        "ppo_clip",
        json_schema_extra=IMPORT_PATH,
        description="ppo_clip, gspo, cispo, gpg, geo_mean, sapo, clip_cov, kl_cov, or 'pkg.mod:fn'",
    )
    loss_aggregation: str | None = Field(
        None,
        json_schema_extra=IMPORT_PATH,
        description="token_mean, token_sum, seq_mean_token_sum, seq_mean_token_mean, seq_mean_token_sum_norm, or "
        "'pkg.mod:fn'; unset: the method's own (gspo, geo_mean, sapo: seq_mean_token_mean, else dr_grpo: "
        "seq_mean_token_sum_norm, else token_mean)",
    )
    eps_clip: float = Field(0.2, gt=0, description="lower clip of the ratio: 1 - eps_clip")
    eps_clip_high: float | None = Field(None, gt=0, description="upper clip: 1 + eps_clip_high; unset: eps_clip")
    clip_ratio_c: float | None = Field(
        None, gt=1, description="ppo_clip's dual clip: a negative-advantage token's loss is at most -c A; unset: off"
    )
    sapo_tau_pos: float = Field(1.0, gt=0, description="sapo's gate temperature where the advantage is positive")
    sapo_tau_neg: float = Field(1.05, gt=0, description="sapo's gate temperature where it is not")
    clip_cov_ratio: float = Field(2e-4, gt=0, le=1, description="clip_cov: the share of tokens whose gradient is cut")
    clip_cov_lb: float = Field(1.0, description="clip_cov: the covariance above which a token may be cut")
    clip_cov_ub: float = Field(5.0, description="clip_cov: the covariance below which a token may be cut")
    kl_cov_ratio: float = Field(2e-4, gt=0, le=1, description="kl_cov: the share of tokens that get the penalty")
    kl_cov_coef: float = Field(1.0, ge=0, description="kl_cov: the weight of |log r| on those tokens")
    kl_estimator: str = Field(
        "k3",
        json_schema_extra=IMPORT_PATH,
        description="k1, k2 (mse), k3 (low_var_kl), abs, k1+, k3+ (straight-through: k2's gradient), or 'pkg.mod:fn'",
    )
    use_kl_loss: bool = Field(False, description="KL to the starting policy as a loss term, weighted kl_loss_coef")
    kl_loss_coef: float = Field(0.0, ge=0)
    kl_in_reward: bool = Field(
        False, description="KL to the starting policy as a per-token reward penalty, weighted kl_reward_coef"
    )
    kl_reward_coef: float = Field(0.0, ge=0, description="the KL-in-reward weight (the start, when adaptive)")
    kl_reward_target: float | None = Field(
        None, gt=0, description="adaptive KL control: the per-token KL the coefficient steers to; unset: fixed"
    )
    kl_reward_gain: float = Field(0.1, gt=0, description="adaptive KL control: the controller's gain (K_beta)")
    entropy_coef: float = Field(0.0, ge=0)
    use_rollout_logprobs: bool = Field(
        False, description="engine log-probs as the old policy instead of a recompute (then no TIS weight applies)"
    )
    use_tis: bool = Field(
        True, description="weight each token's loss by the bounded ratio trainer_old / rollout (off-policy correction)"
    )
    tis_level: Literal["token", "sequence"] = Field("token", description="one ratio per token, or per sample")
    tis_mode: Literal["clamp", "mask"] = Field(
        "clamp", description="a ratio outside [tis_clip_low, tis_clip] is clamped to the bound, or masked to 0"
    )
    tis_clip: float = Field(2.0, gt=0, description="upper bound of the TIS weight")
    tis_clip_low: float = Field(0.0, ge=0, description="lower bound of the TIS weight")
    rejection_level: Literal["off", "token", "sequence"] = Field(
        "off",
        description="leave out of the loss each token (token), or each sample (sequence: the mean over its tokens), "
        "whose engine/trainer gap rejection_estimator exceeds rejection_threshold",
    )
    rejection_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="the gap per token, from d = log pi_old - log pi_rollout: k1 |d|, k2 d^2/2, k3 exp(-d)+d-1"
    )
    rejection_threshold: float = Field(0.01, gt=0, description="the largest gap kept")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: leave out groups whose rewards are all equal; generate more rounds (up to "
        "rollout.max_generate_rounds) until rollout_batch_size groups differ",
    )
    overlong_buffer_len: int | None = Field(
        None, gt=0, description="DAPO's soft overlong punishment over the last N tokens of max_new_tokens; unset: off"
    )
    overlong_penalty: float = Field(1.0, ge=0, description="the reward taken off a response of max_new_tokens")

    @field_validator("advantage_estimator", "policy_loss", "loss_aggregation", "kl_estimator")
    @classmethod
    def _known_name(cls, name: str | None, info: ValidationInfo) -> str | None:
        return name if name is None else check_algorithm_name(info.field_name, name)

    @model_validator(mode="after")
    def _consistent(self) -> AlgoConfig:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub ({self.clip_cov_ub})")
        if self.rejection_level != "off" and self.use_rollout_logprobs:
            raise ValueError(
                "rejection_level needs the trainer's own old log-probs to measure the gap: set use_rollout_logprobs "
                "to false, or rejection_level to off"
            )
        return self

    @property
    def aggregation(self) -> str:
        """The loss aggregation in effect: the configured one, else the method's own."""
        if self.loss_aggregation is not None:
            return self.loss_aggregation
        if self.policy_loss in ("gspo", "geo_mean", "sapo"):
            return "seq_mean_token_mean"
        if self.advantage_estimator == "dr_grpo":
            return "seq_mean_token_sum_norm"
        return "token_mean"

    @property
    def uses_critic(self) -> bool:
        """Whether advantages come from a learned value function (GAE) rather than from the group's scores."""
        return self.advantage_estimator == "gae"

    @property
    def greedy_baseline(self) -> bool:
        """Whether each prompt also gets a greedy response, whose reward is its samples' baseline (ReMax)."""
        return self.advantage_estimator == "remax"

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer holds the starting policy as a frozen reference."""
        return self.use_kl_loss or self.kl_in_reward

    @property
    def corrects_off_policy(self) -> bool:
        """Whether the loss is weighted by trainer_old / rollout: with rollout log-probs as the old policy the PPO
        ratio is pi_theta / pi_rollout already, and a weight would correct twice."""
        return self.use_tis and not self.use_rollout_logprobs


class TrainConfig(_Section):
    lr: float | None = Field(None, gt=0, description="unset: the preset's (5e-4 on a built-in task, else 1e-6)")
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] | None = Field(
        None, description="unset: the preset's ((0.9, 0.98) on a built-in task, else torch's (0.9, 0.999))"
    )
    grad_clip: float = Field(1.0, gt=0)
    global_batch_size: int = Field(256, gt=0, description="samples per optimizer step")
    micro_batch_size: int = Field(256, gt=0, description="samples per forward/backward, at most")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="padded tokens (samples x the longest of them) per forward/backward, at most: micro-batches of "
        "short samples take more of them (a longer sample goes alone); unset: the preset's (none on a built-in task: "
        "micro_batch_size samples each; else 8192)",
    )
    logits_chunk_mb: float = Field(
        64.0,
        gt=0,
        description="the output head runs this many MiB of float32 logits at a time (positions x vocabulary), so "
        "that a micro-batch's memory does not grow with its length times the vocabulary",
    )
    num_passes: int = Field(1, gt=0, description="passes over each rollout")
    num_threads: int = Field(2, gt=0, description="torch threads of the train actor")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="torch device of the trainer: cpu or cuda")
    num_workers: int = Field(1, gt=0, description="trainer workers: Ray actors in one torch.distributed group")
    sharding: Literal["none", "fsdp"] | None = Field(
        None,
        description="fsdp: FSDP2 per decoder layer plus the root; none: one unsharded process; "
        "unset: fsdp when num_workers > 1 or param_dtype is not float32",
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="compute dtype of the sharded model; gradients are reduced and stepped in float32"
    )
    gradient_checkpointing: bool | None = Field(
        None,
        description="recompute each layer's activations in the backward; unset: the preset's (off on a built-in "
        "task, on for own data)",
    )
    weight_bucket_mb: float = Field(
        512.0, gt=0, description="full tensors gathered at a time when weights leave a sharded trainer"
    )
    placement: Literal["pack", "spread"] = Field(
        "pack", description="trainer workers on as few nodes as possible, or across nodes"
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


DEFAULT_JUDGE_TEMPLATE = (
    "Question: {prompt}\nReference answer: {label}\nAnswer to judge: {response}\n"
    "Is the answer to judge correct? Reply yes or no.\n"
)


class JudgeConfig(_Section):
    """The generative judge (data.reward=judge): a model of its own, served by engines of its own (the rollout's
    engine kind, device and dtype), asked for a verdict on each sample of a rollout round in one batch."""

    model_path: str | None = Field(None, json_schema_extra=FILE_PATH, description="the judge: a Hugging Face causal LM")
    num_engines: int = Field(1, gt=0, description="engines serving the judge")
    prompt_template: str = Field(
        DEFAULT_JUDGE_TEMPLATE, description="the judge's prompt: str.format fields {prompt}, {response} and {label}"
    )
    apply_chat_template: bool = Field(False, description="give the prompt as a user message in the judge's template")
    system_prompt: str | None = Field(None, description="a system message before it (with apply_chat_template)")
    verdict: str = Field(
        "yes_no",
        json_schema_extra=IMPORT_PATH,
        description="how the judge's reply becomes a reward: yes_no (its first yes or no: 1 or 0), score (its first "
        "number), same_answer (1 when the judge's own answer, stripped, is the response's), or 'pkg.mod:fn' "
        "(reply, response, label) -> float or None; a reply it cannot read fails its sample",
    )
    max_new_tokens: int = Field(16, gt=0, description="the judge's reply, at most (greedy)")


class RewardModelConfig(_Section):
    """The reward model (data.reward=reward_model): a sequence-classification model's score of prompt + response, run
    batched in a Ray actor of its own."""

    model_path: str | None = Field(
        None, json_schema_extra=FILE_PATH, description="a Hugging Face sequence-classification model of one label"
    )
    batch_size: int = Field(32, gt=0, description="samples per forward")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    num_threads: int = Field(2, gt=0, description="torch threads of the reward model's actor")


class CriticConfig(_Section):
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
    num_workers: int = Field(1, gt=0, description="critic workers: Ray actors in one torch.distributed group")


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterConfig(_Section):
    """One LoRA adapter of the multi-LoRA flow: its own data, reward, optimizer and step budget on the shared base."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,39}$", description="lowercase letters, digits and dashes")
    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGET_MODULES), min_length=1)
    data: DataConfig = DataConfig()
    lr: float = Field(2e-3, gt=0)
    num_steps: int = Field(100, gt=0, description="rollouts this adapter trains on before it retires")
    rollout_batch_size: int = Field(32, gt=0, description="prompts per rollout")
    n_samples_per_prompt: int = Field(8, gt=0)
    global_batch_size: int | None = Field(
        None, gt=0, description="samples per optimizer step; unset: the whole rollout"
    )
    eval: EvalConfig = Field(EvalConfig(), description="this adapter's evaluation (unset: as eval for its data)")
    trainer_group: str = Field(
        "main",
        pattern=r"^[a-z][a-z0-9-]{0,39}$",
        description="the trainer group that trains it (train.num_workers workers of its own); the adapters of a "
        "group take turns on it, groups train at the same time",
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


class TenantsConfig(_Section):
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


# The settings a field left unset takes (RunConfig._preset). A built-in task: today's embedded-model values (4-token
# answers; a 0.5M-parameter model learns at 5e-4). The user's own data, on a pretrained model: the peers' common
# values (docs/guides/real-models.md, "Presets", says where each comes from).
EMBEDDED_TASK_PRESET: dict[tuple[str, str], Any] = {
    ("rollout", "max_new_tokens"): 4,
    ("train", "lr"): 5e-4,
    ("train", "adam_betas"): (0.9, 0.98),
    ("train", "gradient_checkpointing"): False,
    ("critic", "lr"): 2e-3,
}
OWN_DATA_PRESET: dict[tuple[str, str], Any] = {
    ("rollout", "max_new_tokens"): 1024,
    ("train", "lr"): 1e-6,
    ("train", "adam_betas"): (0.9, 0.999),
    ("train", "max_tokens_per_micro_batch"): 8192,
    ("train", "gradient_checkpointing"): True,
    ("critic", "lr"): 1e-5,
}


# The fields a run may change in its middle (docs/guides/control.md, "Change settings mid-run, on the record"), by
# their name in the pause form: they change how the rollouts after the change are sampled and trained, how long the
# run goes and what is due, never what a stored rollout means. A rollout's sampling temperature is its own: the
# trainer reads a rollout's log-probs at the temperature in effect at that rollout.
MID_RUN_FIELDS = {
    "lr": "train.lr",
    "temperature": "rollout.temperature",
    "kl_loss_coef": "algo.kl_loss_coef",
    "entropy_coef": "algo.entropy_coef",
    "num_rollout": "num_rollout",
    "save_interval": "save_interval",
    "eval_interval": "eval.interval",
}


class ConfigChange(_Section):
    """Values that take effect at `rollout_id` and after: a run's schedule of changes (`RunConfig.changes`), or a
    change made while the run was paused (recorded in run.json with who made it and why)."""

    rollout_id: int = Field(ge=0, description="the first rollout the values apply to")
    values: dict[str, Any] = Field(description="config field (dotted, e.g. train.lr) -> its value from rollout_id on")
    by: str = Field("", description="who made the change")
    reason: str = ""
    time: float | None = Field(None, description="when it was made (seconds since the epoch)")

    @field_validator("values")
    @classmethod
    def _mid_run_fields(cls, values: dict[str, Any]) -> dict[str, Any]:
        allowed = set(MID_RUN_FIELDS.values())
        refused = sorted(set(values) - allowed)
        if refused:
            raise ValueError(
                f"{', '.join(refused)} cannot change in the middle of a run (what a stored rollout means would "
                f"change); these can: {', '.join(sorted(allowed))}"
            )
        return values


class MidRunSettings(_Section):
    """The values a paused run may change (MID_RUN_FIELDS), by their name in the pause form, with who changes them and
    why. `of(config)` holds the values in effect; `change(...)` is what differs from them."""

    lr: float = Field(gt=0, description="train.lr: the optimizer's learning rate")
    temperature: float = Field(ge=0, description="rollout.temperature: sampling temperature of the next rollouts")
    kl_loss_coef: float = Field(ge=0, description="algo.kl_loss_coef: weight of the KL loss (algo.use_kl_loss)")
    entropy_coef: float = Field(ge=0, description="algo.entropy_coef: weight of the entropy bonus")
    num_rollout: int = Field(gt=0, description="num_rollout: where the run ends")
    save_interval: int = Field(gt=0, description="save_interval: a checkpoint every N rollouts")
    eval_interval: int | None = Field(None, gt=0, description="eval.interval: an evaluation every N rollouts")
    changed_by: str = Field("", description="who makes the change (recorded with it)")
    reason: str = Field("", description="why (recorded with it)")

    @classmethod
    def of(cls, config: RunConfig, rollout_id: int) -> MidRunSettings:
        """The values in effect at `rollout_id`."""
        config = config.at(rollout_id)
        return cls(**{name: field_value(config, field) for name, field in MID_RUN_FIELDS.items()})

    def change(self, config: RunConfig, rollout_id: int) -> ConfigChange | None:
        """The values that differ from those in effect at `rollout_id`, as a change from `rollout_id` on (None: none)."""
        current = self.of(config, rollout_id)
        values = {
            field: getattr(self, name)
            for name, field in MID_RUN_FIELDS.items()
            if getattr(self, name) != getattr(current, name)
        }
        if not values:
            return None
        return ConfigChange(
            rollout_id=rollout_id, values=values, by=self.changed_by, reason=self.reason, time=time.time()
        )


def field_value(config: BaseModel, field: str) -> Any:
    """The value of the dotted `field` (e.g. train.lr) of `config`."""
    for name in field.split("."):
        config = getattr(config, name)
    return config


class RunConfig(_Section):
    run_dir: str = Field("runs/tiny", json_schema_extra=FILE_PATH)
    seed: int = 0
    num_rollout: int = Field(300, gt=0, description="total rollouts of the run (a resumed run goes on to this)")
    save_interval: int = Field(50, gt=0, description="checkpoint every N rollouts (and at the end)")
    update_weights_interval: int = Field(1, gt=0, description="push weights to the engines every N rollouts")
    iterations_per_run: int | None = Field(
        None,
        gt=0,
        description="train at most this many rollouts per flow run, then checkpoint and exit (scheduled runs)",
    )
    ray_address: str | None = Field(None, description="existing Ray cluster; unset starts a local one")
    accept_config_change: bool = Field(
        False,
        description="resume a run whose config changed in a field that changes what a rollout or a step means "
        '(docs/getting-started.md, "Resuming a run"); unset: such a start is refused, with the difference',
    )
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    train: TrainConfig = TrainConfig()
    critic: CriticConfig = CriticConfig()
    judge: JudgeConfig = JudgeConfig()
    reward_model: RewardModelConfig = RewardModelConfig()
    logging: LoggingConfig = LoggingConfig()
    alerts: AlertsConfig = AlertsConfig()
    eval: EvalConfig = EvalConfig()
    adapters: list[AdapterConfig] = Field(
        default_factory=list,
        description="LoRA adapters of the multi-LoRA flow; unset on the embedded model: one per built-in task",
    )
    tenants: TenantsConfig = TenantsConfig()
    changes: list[ConfigChange] = Field(
        default_factory=list,
        description="values that change at a given rollout (e.g. train.lr from rollout 50 on); a paused run's changes "
        "are recorded in its run.json and applied on top",
    )
    _at_rollout: dict[int, RunConfig] = PrivateAttr(default_factory=dict)

    @field_validator("changes")
    @classmethod
    def _in_rollout_order(cls, changes: list[ConfigChange]) -> list[ConfigChange]:
        return sorted(changes, key=lambda change: change.rollout_id)

    def at(self, rollout_id: int) -> RunConfig:
        """The config in effect at `rollout_id`: `changes` due by then applied in order."""
        due = sum(1 for change in self.changes if change.rollout_id <= rollout_id)
        if not due:
            return self
        if due not in self._at_rollout:
            data = self.model_dump()
            for change in self.changes[:due]:
                for field, value in change.values.items():
                    *sections, name = field.split(".")
                    node = data
                    for section in sections:
                        node = node[section]
                    node[name] = value
            try:
                self._at_rollout[due] = RunConfig.model_validate(data)
            except ValidationError as err:
                raise ConfigError(_format_validation_error(err, f"changes due at rollout {rollout_id}")) from None
        return self._at_rollout[due]

    @property
    def final(self) -> RunConfig:
        """The config once every change has taken effect (its num_rollout is where the run ends)."""
        return self.at(self.changes[-1].rollout_id) if self.changes else self

    def with_changes(self, changes: list[ConfigChange]) -> RunConfig:
        """This config with `changes` added to its schedule (those it holds already are not repeated)."""
        added = [change for change in changes if change not in self.changes]
        if not added:
            return self
        return RunConfig.model_validate({**self.model_dump(), "changes": [*self.changes, *added]})

    @model_validator(mode="after")
    def _preset(self) -> RunConfig:
        """The fields left unset take the preset of the run's data: a built-in task's (the embedded model's short
        answers), or the field's defaults for a model on the user's own data (docs/guides/real-models.md, "Presets")."""
        preset = EMBEDDED_TASK_PRESET if self.data.task is not None else OWN_DATA_PRESET
        for (section, name), value in preset.items():
            if getattr(getattr(self, section), name) is None:
                setattr(getattr(self, section), name, value)
        return self

    @model_validator(mode="after")
    def _batch_shapes(self) -> RunConfig:
        samples = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
        if samples % self.train.global_batch_size:
            raise ValueError(
                f"train.global_batch_size ({self.train.global_batch_size}) must divide "
                f"rollout.rollout_batch_size x rollout.n_samples_per_prompt ({samples})"
            )
        if self.algo.tis_clip_low > self.algo.tis_clip:
            raise ValueError(
                f"algo.tis_clip_low ({self.algo.tis_clip_low}) must not exceed algo.tis_clip ({self.algo.tis_clip})"
            )
        if self.algo.overlong_buffer_len is not None and self.algo.overlong_buffer_len > self.rollout.max_new_tokens:
            raise ValueError(
                f"algo.overlong_buffer_len ({self.algo.overlong_buffer_len}) must not exceed "
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens})"
            )
        if self.rollout.max_generate_rounds > 1 and not self.algo.dynamic_sampling:
            raise ValueError("rollout.max_generate_rounds > 1 draws more prompts only with algo.dynamic_sampling=true")
        if self.algo.dynamic_sampling and self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                "algo.dynamic_sampling needs rollout.n_samples_per_prompt >= 2: a group of one has no reward spread"
            )
        if self.train.global_batch_size % self.train.num_workers:
            raise ValueError(
                f"train.num_workers ({self.train.num_workers}) must divide "
                f"train.global_batch_size ({self.train.global_batch_size})"
            )
        if (
            self.rollout.weight_transport == "distributed"
            and self.rollout.device.split(":")[0] != self.train.device.split(":")[0]
        ):
            raise ValueError(
                f"rollout.weight_transport=distributed broadcasts from the trainer to the engines over one backend "
                f"(gloo on CPU, NCCL on CUDA): train.device ({self.train.device}) and rollout.device "
                f"({self.rollout.device}) must both be cpu or both cuda"
            )
        if self.algo.uses_critic:
            if self.critic.num_workers > 1 and self.train.sharding == "none":
                raise ValueError(f"critic.num_workers={self.critic.num_workers} needs train.sharding fsdp or unset")
            if self.train.global_batch_size % self.critic.num_workers:
                raise ValueError(
                    f"critic.num_workers ({self.critic.num_workers}) must divide "
                    f"train.global_batch_size ({self.train.global_batch_size})"
                )
            if self.adapters:
                raise ValueError("algo.advantage_estimator=gae trains a critic of the full model; adapters have none")
        for reward, section in (("judge", self.judge), ("reward_model", self.reward_model)):
            if reward in self.rewards_used and section.model_path is None:
                raise ValueError(f"data.reward={reward} needs {reward}.model_path")
        if self.rollout.colocate and self.adapters:
            raise ValueError(
                "rollout.colocate=true pairs the engines with the policy's trainer ranks; the multi-LoRA flow's "
                "trainer groups take GPUs of their own: set rollout.colocate=false"
            )
        names = [adapter.name for adapter in self.adapters]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"adapters: names must be unique; repeated: {repeated}")
        return self

    @property
    def ray_actors(self) -> int:
        """The Ray actors a run starts: its engines and its trainer workers (of each trainer group)."""
        groups = len({adapter.trainer_group for adapter in self.adapters}) or 1
        critic = self.critic.num_workers if self.algo.uses_critic else 0
        judges = self.judge.num_engines if "judge" in self.rewards_used else 0
        reward_model = 1 if "reward_model" in self.rewards_used else 0
        return self.rollout.num_engines + groups * self.train.num_workers + critic + judges + reward_model

    @property
    def rewards_used(self) -> set[str]:
        """The rewards the run scores with: its data's, its eval data sets' and its adapters'."""
        data = [self.data, *(self.eval.datasets or []), *(a.data for a in self.adapters)]
        return {d.reward for d in data}

    def critic_view(self) -> RunConfig:
        """The run as the critic's trainer group sees it: critic.num_workers workers at critic.lr, with the policy
        trainer's other settings."""
        train = self.train.model_copy(update={"num_workers": self.critic.num_workers, "lr": self.critic.lr})
        return self.model_copy(update={"train": train, "run_dir": str(RunDir(self.run_dir).critic().path)})

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def eval_datasets(self) -> list[EvalDatasetConfig]:
        """The evaluation data sets in effect: eval.datasets, else a greedy sample of a built-in training task."""
        if self.eval.datasets is not None:
            return list(self.eval.datasets)
        if self.data.task is None:
            return []
        return [EvalDatasetConfig(name=self.data.task, task=self.data.task, max_prompts=DEFAULT_EVAL_PROMPTS)]

    def should_evaluate(self, rollout_id: int) -> bool:
        """Whether the evaluation schedule has one at rollout `rollout_id` (before training it; num_rollout: the end)."""
        if not self.eval_datasets or not 0 <= rollout_id <= self.num_rollout:
            return False
        if rollout_id == 0:
            return self.eval.before_training
        interval = self.eval.interval
        return rollout_id == self.num_rollout or (interval is not None and rollout_id % interval == 0)

    def adapter_view(self, adapter: AdapterConfig) -> RunConfig:
        """The run as one adapter sees it: its data, batch sizes, lr, step budget and seed, in <run_dir>/adapters/<name>."""
        samples = adapter.rollout_batch_size * adapter.n_samples_per_prompt
        global_batch = adapter.global_batch_size or samples
        data = self.model_dump()
        data.update(
            run_dir=str(RunDir(self.run_dir).adapter(adapter.name).path),
            seed=adapter_run_seed(self.seed, adapter.name),
            num_rollout=adapter.num_steps,
            data=adapter.data.model_dump(),
            eval=adapter.eval.model_dump(),
            adapters=[],
            changes=[],
        )
        data["rollout"].update(
            rollout_batch_size=adapter.rollout_batch_size, n_samples_per_prompt=adapter.n_samples_per_prompt
        )
        data["train"].update(
            lr=adapter.lr,
            global_batch_size=global_batch,
            micro_batch_size=min(self.train.micro_batch_size, global_batch),
        )
        try:
            return RunConfig.model_validate(data)
        except ValidationError as err:
            raise ConfigError(_format_validation_error(err, f"adapter {adapter.name!r}")) from None


# Fields a run may change between its starts (docs/getting-started.md, "Resuming a run"): they say how long the run
# goes, where it runs and with what resources, how it is evaluated and logged, how the engines and the trainer compute
# (the same samples and the same steps, up to float rounding), and how long a reward may take. Every other field, and
# every field added later, changes what a rollout or a step means, and is compared. `*` stands for any adapter's name.
CHANGES_FREELY = (
    "num_rollout",
    "iterations_per_run",
    "save_interval",
    "run_dir",
    "ray_address",
    "accept_config_change",
    "eval",
    "logging",
    "alerts",
    "tenants",
    "changes",
    "rollout.engine",
    "rollout.num_engines",
    "rollout.num_threads",
    "rollout.device",
    "rollout.dtype",
    "rollout.engine_timeout_s",
    "rollout.max_running_requests",
    "rollout.pause_generation_mode",
    "rollout.weight_transport",
    "rollout.colocate",
    "rollout.push_check_atol",
    "rollout.sglang",
    "data.reward_timeout_s",
    "data.reward_concurrency",
    "train.num_threads",
    "train.device",
    "train.num_workers",
    "train.sharding",
    "train.micro_batch_size",
    "train.max_tokens_per_micro_batch",
    "train.logits_chunk_mb",
    "train.gradient_checkpointing",
    "train.weight_bucket_mb",
    "train.placement",
    "critic.num_workers",
    "judge.num_engines",
    "reward_model.batch_size",
    "reward_model.device",
    "reward_model.num_threads",
    "adapters.*.num_steps",
    "adapters.*.eval",
    "adapters.*.trainer_group",
)


def config_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'field: recorded -> current' for each field (of the JSON forms of two RunConfigs) that differs and is not one
    that changes freely. Adapters are matched by name: one added or removed is no change of the others."""
    before, after = _flat(recorded), _flat(current)
    return [
        f"{field}: {json.dumps(before[field])} -> {json.dumps(after[field])}"
        for field in sorted(before.keys() & after.keys())
        if before[field] != after[field] and not _changes_freely(field)
    ]


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for name, value in config.items():
        field = f"{prefix}{name}"
        if field == "adapters":
            value = {adapter["name"]: adapter for adapter in value}
        if isinstance(value, dict):
            flat |= _flat(value, f"{field}.")
        else:
            flat[field] = value
    return flat


def _changes_freely(field: str) -> bool:
    parts = field.split(".")
    pattern = ".".join(["adapters", "*", *parts[2:]]) if parts[0] == "adapters" and len(parts) > 2 else field
    return any(pattern == safe or pattern.startswith(f"{safe}.") for safe in CHANGES_FREELY)


def recorded_changes(run_dir: RunDir) -> list[ConfigChange]:
    """The changes made in the middle of the run in `run_dir` (run.json), to apply on top of a start's config."""
    return [ConfigChange.model_validate(change) for change in run_dir.recorded_changes()]


class ConfigError(ValueError):
    """A config that cannot run; the message names the field (and the file, when there is one)."""


def _format_validation_error(err: ValidationError, source: str) -> str:
    problems = []
    for item in err.errors():
        message = item["msg"].removeprefix("Value error, ")
        field = ".".join(str(p) for p in item["loc"])
        problems.append(f"{field}: {message}" if field else message)
    if len(problems) == 1:
        return f"invalid config ({source}): {problems[0]}"
    return "\n  ".join([f"invalid config ({source}):", *problems])


def _parse_override(text: str, schema: type[BaseModel]) -> tuple[list[str], Any]:
    """`a.b=value` as (keys, value): a string field takes the text as it is (`null` unsets an optional one); any
    other field takes the text as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form a.b=value")
    keys = key.split(".")
    kind = _field_kind(keys, schema)
    if kind in (str, str | None):
        return keys, None if kind is not str and raw in ("null", "~") else raw
    try:
        return keys, yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({_yaml_problem(exc)})") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong, and where, in one line."""
    mark = getattr(exc, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{getattr(exc, 'problem', None) or str(exc).splitlines()[0]}{where}"


def _field_kind(keys: list[str], schema: type[BaseModel]) -> Any:
    """The annotation of the `schema` field at `keys` (list items by index), or None when there is no such field."""
    kind: Any = schema
    for key in keys:
        if get_origin(kind) is list and key.isdigit():
            kind = get_args(kind)[0]
            continue
        if get_origin(kind) in (Union, UnionType):  # an optional section, e.g. `list[...] | None`
            kind = next((k for k in get_args(kind) if k is not type(None)), None)
            if get_origin(kind) is list and key.isdigit():
                kind = get_args(kind)[0]
                continue
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)) or key not in kind.model_fields:
            return None
        kind = kind.model_fields[key].annotation
    return kind


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, **fields: Any) -> RunConfig:
    """Build a RunConfig from an optional YAML file, `a.b=value` overrides, then explicit top-level fields."""
    return _load(RunConfig, path, overrides, fields)


def load_adapter_config(path: str | Path | None = None, overrides: list[str] | None = None) -> AdapterConfig:
    """Build an AdapterConfig (a tenant's) from an optional YAML file and `a.b=value` overrides."""
    return _load(AdapterConfig, path, overrides, {})


def _load(schema: type[_Section], path: str | Path | None, overrides: list[str] | None, fields: dict[str, Any]) -> Any:
    source = str(path) if path else "defaults"
    data: dict[str, Any] = {}
    if path:
        try:
            content = Path(path).read_bytes()
            loaded = yaml.safe_load(content.decode("utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            line = content[: exc.start].count(b"\n") + 1
            raise ConfigError(f"config file {path} is not UTF-8 text (line {line}: {exc.reason})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded or {}
    return _apply(schema, data, overrides, fields, source)


def override_config(base: RunConfig, overrides: list[str], **fields: Any) -> RunConfig:
    """`base` with `a.b=value` overrides, then explicit top-level fields, applied."""
    return _apply(RunConfig, base.model_dump(mode="json"), overrides, fields, "overrides")


def _apply(
    schema: type[_Section], data: dict[str, Any], overrides: list[str] | None, fields: dict[str, Any], source: str
) -> Any:
    for text in overrides or []:
        keys, value = _parse_override(text, schema)
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {key} is not a section")
        node[keys[-1]] = value
    data.update({k: v for k, v in fields.items() if v is not None})
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None
