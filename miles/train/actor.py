"""TrainActor: the policy, its optimizer and the RL update; one rank of the trainer group, run inside a Ray actor."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.cluster.placement import torch_device
from miles.config import RunConfig
from miles.state.checkpoint import (
    MODEL_DIR,
    load_optimizer,
    save_optimizer,
    staging_path,
    weights_dtype,
    write_checkpoint_from_ranks,
)
from miles.state.run_dir import RunDir
from miles.state.seeds import train_seed
from miles.train.algorithms import resolve_estimator
from miles.train.sharding import bucket_specs, full_state_dict, full_tensor_buckets, join_trainer_group, shard_model
from miles.train.update import batch_logprobs, set_lr, train_on_rollout, with_kl_reward_coef
from miles.weights.check import WeightProbe, take_probe
from miles.weights.group import Membership, TensorSpec, WeightGroup, send_bucket
from miles.weights.payload import serialize_bucket

log = logging.getLogger(__name__)


class TrainActor:
    """Rank `rank` of `world_size` trainer workers. Every rank gets every call, in the same order (one SPMD program):
    with `train.sharding=fsdp` the ranks form one torch.distributed group through `rendezvous` (`host:port` on rank
    0's node), shard the model and each global batch; rank 0 alone writes the checkpoint's own files
    and returns the weights."""

    def __init__(
        self,
        config: RunConfig,
        model_dir: str,
        checkpoint: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        rendezvous: str | None = None,
    ):
        train = config.train
        torch.set_num_threads(train.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.rank = rank
        self.device = torch_device(train.device)
        self.run_dir = RunDir(config.run_dir)
        if not self.run_dir.path.is_dir():
            raise RuntimeError(
                f"trainer worker {rank} cannot read the run directory {self.run_dir.path} from its node: "
                "the run directory must be on storage that every node sees (a shared file system)"
            )
        if train.sharded:
            join_trainer_group(self.device, rendezvous, rank, world_size)
        source = Path(checkpoint) / MODEL_DIR if checkpoint else Path(model_dir)
        # The model's own dtype, which checkpoints and weight files keep; the trainer holds float32 master weights
        # (saved with the optimizer state where the model's dtype is narrower).
        self.weights_dtype = weights_dtype(source)
        self.model = self._load(source).train()
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        self.pad_token_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train.lr, betas=train.adam_betas, weight_decay=train.weight_decay
        )
        if checkpoint:
            load_optimizer(self.model, self.optimizer, Path(checkpoint))  # with the master weights, where saved
        self.ref_model = None
        if config.algo.needs_reference and self.holds_reference:
            # The reference is the run's starting policy, not the checkpoint it resumed from.
            self.ref_model = self._load(Path(model_dir)).eval()
            self.ref_model.requires_grad_(False)
        # What the ledger says was trained into these weights; the driver records each new rollout there, so a
        # retried call is answered from here without a second step.
        self.trained = dict(self.run_dir.ledger().trained)
        self._weight_group = Membership()  # rank 0's place in the weight-update group it broadcasts over
        self._payloads: Iterator[list[str] | None] | None = None  # a tensor push's buckets still to come
        self._payload_weights: torch.Tensor | None = None  # the flattened bucket the last payload points to
        self._probe_ids: list[int] | None = None  # the push check's sequence (weight_probe)

    holds_reference = True  # the starting policy, for the KL terms (the critic holds none)

    def _from_pretrained(self, source: Path) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)

    def _load(self, source: Path) -> torch.nn.Module:
        train = self.config.train
        model = self._from_pretrained(source)
        if train.gradient_checkpointing:
            model.config.use_cache = False  # no KV cache while training: it would keep what checkpointing frees
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if train.sharded:
            shard_model(model, self.device.type, train.param_dtype)
        else:
            model.to(self.device)
        return model

    def change_config(self, config: RunConfig) -> None:
        """Train the rollouts after this call with `config` (the run's config with changes added to its schedule)."""
        self.config = config

    def train(self, rollout_id: int, table: pa.Table) -> dict[str, float]:
        """Run this rollout's optimizer steps once; a second call for the same rollout_id only returns its metrics (the
        driver records them in the ledger)."""
        if rollout_id in self.trained:
            return self.trained[rollout_id]
        torch.manual_seed(train_seed(self.config.seed, rollout_id, self.rank))
        config = with_kl_reward_coef(self.config.at(rollout_id), self.trained, rollout_id)
        if rollout_id < config.critic.warmup_rollouts and resolve_estimator(config.algo).needs_critic:
            self.trained[rollout_id] = {"critic_warmup": 1.0}  # the policy waits for a critic worth its advantages
            return self.trained[rollout_id]
        set_lr(self.optimizer, config.train.lr)
        reference = None
        if self.ref_model is not None:
            reference = partial(batch_logprobs, self.ref_model, config=config, device=self.device)
        metrics = train_on_rollout(
            self.model,
            self.optimizer,
            list(self.model.parameters()),
            table,
            config,
            self.device,
            self.pad_token_id,
            reference,
        )
        self.trained[rollout_id] = metrics
        return metrics

    @property
    def _bucket_bytes(self) -> int:
        return int(self.config.train.weight_bucket_mb * 2**20)

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The full weights on rank 0, gathered train.weight_bucket_mb at a time; None on the other ranks."""
        if self.rank == 0:
            return full_state_dict(self.model, self._bucket_bytes)
        for _ in full_tensor_buckets(self.model, self._bucket_bytes):
            pass  # this rank's part of each gather
        return None

    def free_address(self) -> tuple[str, int]:
        """An address on this rank's node for a process group this rank is rank 0 of (the weight-update group)."""
        from miles.cluster.actors import free_address  # Ray's: the trainer also runs in a process without Ray

        return free_address()

    def weight_bucket_specs(self, dtype: str | None = None) -> list[list[TensorSpec]]:
        """What `broadcast_weights` sends, bucket by bucket: (name, dtype, shape) of each tensor."""
        return bucket_specs(self.model, self._bucket_bytes, dtype)

    def weight_probe(self, dtype: str | None = None) -> WeightProbe:
        """The push check of the weights held now (miles.weights.check), of the weights cast to the served `dtype`
        (unset: the model's own); every rank takes part. The sequence is the greedy one of the weights this actor
        started from, kept: one forward a push, where a new greedy sequence would take seventeen (each a round of
        collectives when sharded), and a sequence likely then stays likely over a run's small steps."""
        probe = take_probe(
            self.model, self.device, self.config.rollout.push_check_atol, dtype or self.weights_dtype, self._probe_ids
        )
        self._probe_ids = probe.token_ids
        return probe

    def broadcast_weights(self, group: WeightGroup, load_format: str | None, dtype: str | None = None) -> str | None:
        """Rank 0 broadcasts the full weights over the weight-update `group` (joining it first if it is new), a
        bucket at a time as `weight_bucket_specs` lists them, in the engines' `load_format` (flattened or tensor by
        tensor) and cast to the `dtype` they serve (a bf16 engine gets half the bytes of fp32 weights); every rank
        takes part in each bucket's gathers.

        Returns None, or the error when the group failed (a peer died): rank 0 then still takes its part in the
        remaining gathers, so that the trainer group stays whole, and leaves the broken group."""
        sending = self.rank == 0
        error = None
        try:
            process_group = self._weight_group.of(group, rank=0) if sending else None
        except RuntimeError as exc:
            error = exc
        for bucket in full_tensor_buckets(self.model, self._bucket_bytes, device=self.device, copy=False):
            if not sending:
                continue  # this rank's part of each gather
            if error is None:
                try:
                    tensors = [t.to(getattr(torch, dtype)) if dtype else t for t in bucket.values()]
                    send_bucket(process_group, tensors, load_format)
                except RuntimeError as exc:
                    error = exc
        if error is not None:
            self._weight_group.leave()
            return f"broadcast over weight-update group {group.group_name} failed: {error}"
        return None

    def begin_weight_payloads(self, dtype: str | None = None, senders: int = 1) -> int:
        """Start a tensor push of the full weights cast to the engines' `dtype`: returns the number of buckets, which
        `next_weight_payload` then hands over one at a time (every rank takes each call: each bucket is a gather)."""
        self.release_payload_weights()
        self._payloads = self._weight_payloads(dtype, senders)
        return len(bucket_specs(self.model, self._bucket_bytes, dtype))

    def next_weight_payload(self) -> list[str] | None:
        """The next bucket as SGLang's `/update_weights_from_tensor` payload (a list of one flattened bucket, the
        `payloads` of an engine's call), on the ranks that send (None on the others): rank i's for the engine on its
        own GPU when engines are colocated with the ranks, rank 0's for every engine otherwise. On the GPU it is a
        CUDA IPC handle to a bucket this actor keeps until the next call or `release_payload_weights`, so that the
        servers map it, not copy it: one bucket is in flight, never a second copy of the model."""
        self._payload_weights = None
        return next(self._payloads)

    def _weight_payloads(self, dtype: str | None, senders: int) -> Iterator[list[str] | None]:
        sending = self.rank < senders  # the others take their part in each gather
        for bucket in full_tensor_buckets(self.model, self._bucket_bytes, device=self.device, copy=False):
            payloads = None
            if sending:
                payload, self._payload_weights = serialize_bucket(bucket, getattr(torch, dtype) if dtype else None)
                payloads = [payload]
            del bucket  # the gathered tensors go while the servers load: only the flattened copy stays
            yield payloads

    def release_payload_weights(self) -> None:
        """The servers have loaded the last payload, or the push stopped: its bucket and the gathers can go."""
        self._payloads, self._payload_weights = None, None

    def write_weights(self, directory: str, dtype: str | None = None) -> str:
        """Write the full weights as a Hugging Face model directory an engine loads, in the `dtype` it serves (unset:
        the model's own). A directory already there is kept, so a retried push never rewrites files an engine may be
        reading."""
        target = Path(directory)
        if target.exists():
            return directory
        staging = staging_path(target)
        self._write_model_dir(staging, dtype or self.weights_dtype)
        if self.rank == 0:
            staging.rename(target)
        return directory

    def _write_model_dir(self, directory: Path, dtype: str) -> None:
        """The full weights cast to `dtype` as a Hugging Face model directory (rank 0 writes; every rank gathers): a
        safetensors file per bucket (indexed when there are several), the config (saying `dtype`), the generation
        config and the tokenizer. Tied weights are written once, as the model declares them."""
        specs = self.weight_bucket_specs(dtype)
        weight_map: dict[str, str] = {}
        for index, bucket in enumerate(full_tensor_buckets(self.model, self._bucket_bytes, copy=False)):
            if self.rank != 0:
                continue
            directory.mkdir(parents=True, exist_ok=True)
            # Hugging Face's names: one file is model.safetensors, several are numbered and indexed
            name = "model.safetensors" if len(specs) == 1 else f"model-{index + 1:05d}-of-{len(specs):05d}.safetensors"
            cast = {key: tensor.to(getattr(torch, dtype)).contiguous() for key, tensor in bucket.items()}
            save_file(cast, directory / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(bucket, name))
        if self.rank != 0:
            return
        if len(specs) > 1:
            total = sum(
                torch.Size(shape).numel() * getattr(torch, kind).itemsize for b in specs for _, kind, shape in b
            )
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = copy.deepcopy(self.model.config)
        config.dtype = dtype
        config.architectures = [type(self.model).__name__.removeprefix("FSDP")]  # the class, not the sharding's
        config.save_pretrained(directory)
        if getattr(self.model, "generation_config", None) is not None:  # a value model has none
            self.model.generation_config.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

    def save_checkpoint(self, rollout_id: int, state: dict[str, Any]) -> str:
        """Write the run's checkpoint of `rollout_id`: the model in HF format in its own dtype (full weights, written
        by rank 0), the optimizer (each rank its shard, with the float32 master weights when the model's dtype is
        narrower), the state; a retried save keeps the checkpoint already there."""

        def write_files(staging: Path) -> None:
            self._write_model_dir(staging / MODEL_DIR, self.weights_dtype)
            save_optimizer(self.model, self.optimizer, staging, master_weights=self.weights_dtype != "float32")

        target = self.run_dir.checkpoint(rollout_id)
        return str(write_checkpoint_from_ranks(target, rollout_id, state, self.rank, write_files))
