"""TorchEngine: continuous batching with a KV cache on a transformers causal LM, CPU or CUDA.

A decode loop of its own runs every request that has arrived, from any number of concurrent `generate` calls, as
one batch: a request that finishes leaves its row at once, and a waiting one takes the free slot at the next
step (`max_running_requests` rows at most), its prompt prefilled and its KV cache joined to the batch's. Each
row's random draws depend on its seed and its own token count only, so a request samples the same tokens whoever
its neighbours are and whenever it joined.

Weights change between two decode steps: a push pauses the loop, loads, and the requests in flight go on with the
new weights (SGLang's `pause_generation`/`continue_generation`): in mode `retract` their KV cache is recomputed
on the new weights, in `in_place` it is kept (always for an adapter push: the other adapters' caches stay valid).
Every token records the version of the weights that produced it.

Colocated with a trainer, it releases its memory around the train step (`release_memory`): its weights are dropped
(the parameters keep their shapes, not their storage) and come back empty for the push that follows; it holds no
KV cache between generations, so on a GPU releasing that returns the allocator's cached blocks to the trainer.

LoRA adapters are served with peft: every loaded adapter sits on the one base model, and a batch may mix
requests of several adapters (and of the base), each row running through its own adapter.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from miles.cluster.placement import torch_device
from miles.config import AdapterConfig, RolloutConfig
from miles.engines.base import (
    WEIGHTS,
    GenerateRequest,
    GenerateResult,
    GenerationProgress,
    check_adapters_loaded,
    check_memory_tags,
    read_safetensors,
    shared_launch_args,
)
from miles.state.checkpoint import tied_names, weights_dtype
from miles.train.logprobs import token_logprobs
from miles.weights.check import weights_checksum
from miles.weights.group import Membership, TensorSpec, WeightGroup, receive_bucket

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch


def _serves_adapters(model: torch.nn.Module) -> bool:
    """Whether `model` is the base wrapped by peft with its adapters. peft is imported by the first adapter load, not
    by every engine start (its import takes seconds): until then no model is a PeftModel."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


PAUSE_MODES = ("abort", "retract", "in_place")  # as SGLang's /pause_generation
_MASK32 = 0xFFFFFFFF


class TorchEngine:
    weight_transports = ("object_store", "disk", "distributed")
    distributed_load_format = None  # tensor by tensor, straight into the parameters

    @classmethod
    def launch_args(
        cls,
        model_dir: str,
        weight_version: int,
        rollout: RolloutConfig,
        adapters: Sequence[AdapterConfig],
        colocated_trainer_bytes: float | None = None,  # it reserves nothing ahead: its KV cache grows with each batch
    ) -> dict[str, Any]:
        dtype = cls.served_dtype(model_dir, rollout)
        return {**shared_launch_args(model_dir, weight_version, rollout, dtype), "num_threads": rollout.num_threads}

    @classmethod
    def ranks(cls, rollout: RolloutConfig) -> int:
        return 1

    @classmethod
    def served_dtype(cls, model_dir: str, rollout: RolloutConfig) -> str:
        if rollout.dtype == "auto":
            return weights_dtype(Path(model_dir)) if rollout.device.startswith("cuda") else "float32"
        return rollout.dtype

    def __init__(
        self,
        model_dir: str,
        weight_version: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        num_threads: int | None = None,
        max_running_requests: int | None = None,
        pause_generation_mode: str = "retract",
    ):
        if num_threads:
            torch.set_num_threads(num_threads)
        if pause_generation_mode not in PAUSE_MODES[1:]:
            raise ValueError(
                f"pause_generation_mode {pause_generation_mode!r}: a push keeps requests: retract or in_place"
            )
        self.device = torch_device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.pad_token_id = self.model.config.pad_token_id or 0
        self.max_running_requests = max_running_requests
        self.pause_generation_mode = pause_generation_mode
        self._weight_version = weight_version
        self._adapter_versions: dict[str, int] = {}
        self._weight_group = Membership()
        self._released: set[str] = set()
        self._released_shapes: dict[str, torch.Size] = {}  # the shape of each dropped parameter
        self._waiting: deque[_Sequence] = deque()
        self._batch: _Batch | None = None
        self._state = threading.Condition()
        self._pauses = 0
        self._stepping = False
        self._closed = False
        self._progress = GenerationProgress()  # written by the decode loop only
        self._loop = threading.Thread(target=self._decode_loop, name="torch-engine-decode", daemon=True)
        self._loop.start()
        atexit.register(self._stop_decoding)

    def weight_version(self) -> int:
        return self._weight_version

    def adapter_versions(self) -> dict[str, int]:
        return dict(self._adapter_versions)

    def load_adapter(self, name: str, named_tensors: dict[str, torch.Tensor], config: dict, version: int) -> None:
        """Load (or replace) LoRA adapter `name` from its PEFT state dict and adapter_config.json contents."""
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        from miles.train.lora import is_adapter_key

        lora = LoraConfig(**{k: v for k, v in config.items() if k in LoraConfig.__dataclass_fields__})
        # In place: the other adapters' rows keep their KV cache, which the new adapter leaves as it was.
        with self.paused("in_place"):
            if not _serves_adapters(self.model):
                self.model = get_peft_model(self.model, lora, adapter_name=name).eval()
            elif name not in self.model.peft_config:
                self.model.add_adapter(name, lora)
            elif self.model.peft_config[name].to_dict() != lora.to_dict():
                self.model.delete_adapter(name)
                self.model.add_adapter(name, lora)
            result = set_peft_model_state_dict(self.model, named_tensors, adapter_name=name)
            missing = [k for k in result.missing_keys if is_adapter_key(k, name)]
            if missing or result.unexpected_keys:
                raise ValueError(
                    f"adapter {name!r}: tensors do not match its config (missing {missing[:3]}, unexpected "
                    f"{result.unexpected_keys[:3]})"
                )
            self.model.eval()
            self._adapter_versions[name] = version

    def unload_adapter(self, name: str) -> None:
        if name not in self._adapter_versions:
            return
        with self.paused("in_place"):
            in_flight = [s for s in self._in_flight() if s.request.adapter == name]
            if in_flight:
                raise ValueError(f"adapter {name!r} has {len(in_flight)} requests in flight; it stays loaded")
            del self._adapter_versions[name]
            if self._adapter_versions:
                if name in self.model.active_adapters:  # hand the role on first, or peft picks one and warns
                    self.model.set_adapter(next(iter(self._adapter_versions)))
                self.model.delete_adapter(name)
            else:  # the last one: back to the plain base model, which takes full weight pushes again
                self.model = self.model.unload().eval()

    def health(self) -> bool:
        return self._loop.is_alive()

    def progress(self) -> GenerationProgress:
        return self._progress

    def shutdown(self) -> None:
        self._stop_decoding()
        del self.model

    @torch.no_grad()
    def release_memory(self, tags: Sequence[str]) -> None:
        tags = [tag for tag in check_memory_tags(tags) if tag not in self._released]
        with self._state:
            while self._stepping:  # a step retires its finished rows after their callers were answered
                self._state.wait()
            if self._in_flight():
                raise RuntimeError(f"release_memory needs an idle engine: {len(self._in_flight())} requests in flight")
            if WEIGHTS in tags:
                if self._adapter_versions:
                    raise ValueError("an engine serving LoRA adapters keeps its base weights: they are never pushed")
                for name, parameter in self.model.named_parameters():  # tied parameters are one, and stay tied
                    self._released_shapes[name] = parameter.shape
                    parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
            self._released.update(tags)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the caching allocator keeps freed blocks from the trainer otherwise

    @torch.no_grad()
    def resume_memory(self, tags: Sequence[str]) -> None:
        tags = [tag for tag in check_memory_tags(tags) if tag in self._released]
        with self._state:
            if WEIGHTS in tags:
                for name, parameter in self.model.named_parameters():
                    shape = self._released_shapes.pop(name)
                    parameter.data = torch.empty(shape, dtype=parameter.dtype, device=parameter.device)
            self._released.difference_update(tags)

    def _check_memory_held(self, what: str) -> None:
        if self._released:
            raise RuntimeError(
                f"{what}: the engine's {sorted(self._released)} memory is released; resume_memory (and push the "
                f"weights) first"
            )

    def _check_weights_held(self) -> None:
        if WEIGHTS in self._released:
            raise RuntimeError("the engine's weights are released: resume_memory(['weights']) before a push")

    def _stop_decoding(self) -> None:
        """End the decode loop after its step, the requests in flight as aborted. Also at interpreter exit: torch
        aborts the process when a thread that ran it is still alive then."""
        with self._state:
            self._closed = True
            while self._stepping:
                self._state.wait()
            self._finish_all("abort")
            self._state.notify_all()
        self._loop.join(timeout=30)

    @torch.inference_mode()
    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        self._check_weights_held()
        if self._adapter_versions:
            raise ValueError("the base weights of an engine serving LoRA adapters are frozen; push adapters instead")
        with self.paused(self.pause_generation_mode):
            loaded = self.model.load_state_dict(named_tensors, strict=False)
            missing = set(loaded.missing_keys) - tied_names(self.model)
            if missing or loaded.unexpected_keys:
                raise RuntimeError(
                    f"pushed weights do not fit the model: missing {sorted(missing)}, "
                    f"unexpected {sorted(loaded.unexpected_keys)}"
                )
            self._weight_version = version

    def update_weights_from_disk(self, directory: str, version: int) -> None:
        """Load the weights of a model directory (its safetensors files) written by the trainer."""
        self.update_weights(read_safetensors(Path(directory)), version)

    @torch.inference_mode()
    def update_weights_from_distributed(
        self,
        group: WeightGroup,
        rank_offset: int,
        buckets: list[list[TensorSpec]],
        version: int,
        load_format: str | None = None,
    ) -> None:
        """Receive the weights broadcast over the weight-update `group` (joined as `rank_offset` when new), bucket
        by bucket, into the model: tensor by tensor straight into the parameters, or as flattened buckets. A failed
        broadcast leaves the weights partly updated (as SGLang's do) until the next push lands; as SGLang, a name the
        model does not have is skipped, and the push check finds it out."""
        self._check_weights_held()
        if self._adapter_versions:
            raise ValueError("the base weights of an engine serving LoRA adapters are frozen; push adapters instead")
        process_group = self._weight_group.of(group, rank_offset)
        with self.paused(self.pause_generation_mode):
            parameters = self.model.state_dict()
            for specs in buckets:  # every bucket is received, whatever it holds, so the broadcast stays in step
                for name, tensor in receive_bucket(process_group, specs, self.device, load_format, parameters).items():
                    if name in parameters and tensor is not parameters[name]:
                        parameters[name].copy_(tensor)
            self._weight_version = version

    @torch.inference_mode()
    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        self._check_memory_held("sequence_logprobs")
        with self.paused("in_place"):
            ids = torch.tensor([token_ids], device=self.device)
            model = self.model
            if _serves_adapters(model):
                with model.disable_adapter():
                    logits = model(input_ids=ids).logits
            else:
                logits = model(input_ids=ids).logits
        return token_logprobs(logits.float(), ids)[0, 1:].tolist()

    def weights_checksum(self) -> str | None:
        """A sha256 of every base weight served (name and bytes), as SGLang's `/weights_checker` checksums them."""
        self._check_weights_held()
        model = self.model.get_base_model() if _serves_adapters(self.model) else self.model
        with self.paused("in_place"):
            return weights_checksum(
                (name, tensor) for name, tensor in model.state_dict().items() if "lora_" not in name
            )

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Results in request order, once every request of the call has finished; the requests join whatever the
        engine is decoding for its other callers."""
        if not requests:
            return []
        self._check_memory_held("generate")
        check_adapters_loaded(requests, self._adapter_versions)
        call = _Call([None] * len(requests), remaining=len(requests))
        keys = _row_keys(torch.tensor([r.seed for r in requests], dtype=torch.long)).tolist()
        with self._state:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            self._waiting.extend(_Sequence(r, call, i, k) for i, (r, k) in enumerate(zip(requests, keys, strict=True)))
            self._state.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.results

    def pause_generation(self, mode: str = "retract") -> None:
        """Stop decoding after the step running now; until `continue_generation`, requests in flight wait. `abort`
        ends every request in flight with finish reason "abort", `retract` drops their KV cache (recomputed when
        they continue), `in_place` keeps it. Pauses nest: generation goes on when every pause is continued."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation mode {mode!r}: one of {list(PAUSE_MODES)}")
        with self._state:
            self._pauses += 1
            while self._stepping:
                self._state.wait()
            if mode == "abort":
                self._finish_all("abort")
            elif mode == "retract" and self._batch is not None:
                self._waiting.extendleft(reversed(self._batch.sequences))
                self._batch = None

    def continue_generation(self) -> None:
        with self._state:
            self._pauses = max(0, self._pauses - 1)
            self._state.notify_all()

    @contextmanager
    def paused(self, mode: str) -> Iterator[None]:
        self.pause_generation(mode)
        try:
            yield
        finally:
            self.continue_generation()

    def _in_flight(self) -> list[_Sequence]:
        return [*self._waiting, *(self._batch.sequences if self._batch is not None else [])]

    def _finish_all(self, reason: str) -> None:
        """End every request in flight as `reason` (with what it has generated); called holding the state lock."""
        for sequence in self._in_flight():
            sequence.finish(reason)
        self._waiting.clear()
        self._batch = None

    def _decode_loop(self) -> None:
        while True:
            with self._state:
                while not self._closed and (self._pauses or not (self._waiting or self._batch)):
                    self._state.wait()
                if self._closed:
                    return
                self._stepping = True
                admitted = self._admissions()
            try:
                self._step(admitted)
            except BaseException as exc:  # noqa: BLE001 - every caller in flight gets the error; the loop goes on
                with self._state:
                    for sequence in [*admitted, *self._in_flight()]:
                        sequence.fail(exc)
                    self._waiting.clear()
                    self._batch = None
            finally:
                with self._state:
                    self._stepping = False
                    self._state.notify_all()

    def _admissions(self) -> list[_Sequence]:
        """The waiting requests that take the free slots now (called holding the state lock)."""
        running = len(self._batch.sequences) if self._batch is not None else 0
        free = len(self._waiting) if self.max_running_requests is None else self.max_running_requests - running
        return [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]

    @torch.inference_mode()
    def _step(self, admitted: list[_Sequence]) -> None:
        """Prefill the admitted requests into the batch, then draw one token for every row, retire the rows that
        finished, and run the rest one position on."""
        if admitted:
            joining = self._prefill(admitted)
            self._batch = joining if self._batch is None else self._batch.joined(joining)
        batch = self._batch
        sampled, logprobs = batch.draw()
        tokens, token_logprobs = sampled.squeeze(1).tolist(), logprobs.tolist()
        versions = batch.logits_versions
        finished = batch.advance(sampled)
        for i, sequence in enumerate(batch.sequences):
            sequence.append(tokens[i], token_logprobs[i], versions[i])
        finished_rows = finished.nonzero().squeeze(1).tolist()
        for i in finished_rows:
            batch.sequences[i].finish("stop" if batch.hit_stop[i] else "length")
            self._progress += GenerationProgress(1, len(batch.sequences[i].tokens))
        if finished_rows:
            batch = batch.selected(~finished)
            self._batch = batch if batch.sequences else None
            sampled = sampled[~finished]
        if self._batch is not None:
            self._forward(batch, sampled)

    def _adapter_kwargs(self, sequences: list[_Sequence]) -> dict:
        if not _serves_adapters(self.model):
            return {}
        return {"adapter_names": [s.request.adapter or BASE_ADAPTER for s in sequences]}

    def _prefill(self, sequences: list[_Sequence]) -> _Batch:
        """The sequences as a batch of their own: each prefix (its prompt and what it generated before a retract)
        left-padded, run through the model into a fresh KV cache."""
        dev = self.device
        prefixes = [s.prefix() for s in sequences]
        width = max(len(p) for p in prefixes)
        input_ids = torch.full((len(prefixes), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prefixes), width), dtype=torch.long)
        for i, prefix in enumerate(prefixes):  # left padding, so every row's next token sits in the last column
            input_ids[i, width - len(prefix) :] = torch.tensor(prefix)
            attention[i, width - len(prefix) :] = 1
        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **self._adapter_kwargs(sequences),
        )
        return _Batch.of(
            sequences, out.cache, attention, positions[:, -1:] + 1, out.logits[:, -1], self._versions(sequences), dev
        )

    def _versions(self, sequences: list[_Sequence]) -> list[int]:
        """The weight version each sequence's next logits come from: its adapter's, or the base weights'."""
        adapters = self._adapter_versions
        return [adapters[s.request.adapter] if s.request.adapter else self._weight_version for s in sequences]

    def _forward(self, batch: _Batch, sampled: torch.Tensor) -> None:
        """Every row one position on: the token it drew goes through the model; the logits of its next one come out."""
        batch.attention = torch.cat([batch.attention, torch.ones_like(batch.attention[:, :1])], dim=1)
        out = self.model(
            input_ids=sampled,
            attention_mask=batch.attention,
            position_ids=batch.next_pos,
            cache=batch.cache,
            use_cache=True,
            **self._adapter_kwargs(batch.sequences),
        )
        batch.cache, batch.logits, batch.logits_versions = out.cache, out.logits[:, -1], self._versions(batch.sequences)
        batch.next_pos = batch.next_pos + 1


@dataclass
class _Call:
    """One `generate` call: its results as its requests finish, and the event its caller waits on."""

    results: list[GenerateResult | None]
    remaining: int
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class _Sequence:
    """One request in the engine: what it has generated so far, and the call waiting for it."""

    __slots__ = ("request", "call", "index", "key", "tokens", "logprobs", "versions")

    def __init__(self, request: GenerateRequest, call: _Call, index: int, key: int):
        self.request, self.call, self.index, self.key = request, call, index, key
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def prefix(self) -> list[int]:
        return [*self.request.prompt_ids, *self.tokens]

    def append(self, token: int, logprob: float, version: int) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)

    def finish(self, reason: str) -> None:
        call = self.call
        call.results[self.index] = GenerateResult(self.tokens, self.logprobs, reason, self.versions)
        call.remaining -= 1
        if call.remaining == 0:
            call.done.set()

    def fail(self, error: BaseException) -> None:
        self.call.error = error
        self.call.done.set()


class _Batch:
    """The requests being decoded, one row each: their KV cache (left-padded, so every row's newest token sits in
    the last column), the attention mask over it, each row's next position, the logits of its next token and the
    weight version that computed them, and its sampling parameters as row tensors."""

    ROW_TENSORS = ("keys", "greedy", "temperature", "top_p", "max_new", "steps", "stop_ids", "next_pos", "logits")

    def __init__(self, sequences: list[_Sequence], cache: DynamicCache, attention: torch.Tensor, **rows):
        self.sequences, self.cache, self.attention = sequences, cache, attention
        self.logits_versions: list[int] = rows.pop("logits_versions")
        for name in self.ROW_TENSORS:
            setattr(self, name, rows[name])
        self.hit_stop: list[bool] = []

    @classmethod
    def of(cls, sequences, cache, attention, next_pos, logits, versions, dev) -> _Batch:
        sampling = [s.request.sampling for s in sequences]
        max_stops = max(1, max(len(p.stop_token_ids) for p in sampling))
        stop_ids = torch.full((len(sequences), max_stops), -1, dtype=torch.long)
        for i, p in enumerate(sampling):
            stop_ids[i, : len(p.stop_token_ids)] = torch.tensor(p.stop_token_ids, dtype=torch.long)
        return cls(
            sequences,
            cache,
            attention,
            # Temperature 0 is greedy decoding, as in SGLang: the most likely token, its log-prob at temperature 1.
            keys=torch.tensor([s.key for s in sequences], dtype=torch.long, device=dev),
            greedy=torch.tensor([p.temperature == 0 for p in sampling], device=dev).unsqueeze(1),
            temperature=torch.tensor([p.temperature or 1.0 for p in sampling], device=dev).unsqueeze(1),
            top_p=torch.tensor([p.top_p for p in sampling], device=dev).unsqueeze(1),
            max_new=torch.tensor([p.max_new_tokens for p in sampling], device=dev),
            steps=torch.tensor([len(s.tokens) for s in sequences], dtype=torch.long, device=dev),
            stop_ids=stop_ids.to(dev),
            next_pos=next_pos,
            logits=logits,
            logits_versions=versions,
        )

    def draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row from its logits (a column), and its log-prob at the row's temperature."""
        step_logprobs = torch.log_softmax(self.logits.float() / self.temperature, dim=-1)
        probs = step_logprobs.exp()
        if bool((self.top_p < 1.0).any()):
            probs = _top_p_filter(probs, self.top_p)
        sampled = _sample(probs, _uniform(self.keys, self.steps))
        sampled = torch.where(self.greedy, step_logprobs.argmax(dim=-1, keepdim=True), sampled)
        return sampled, step_logprobs.gather(1, sampled).squeeze(1)

    def advance(self, sampled: torch.Tensor) -> torch.Tensor:
        """Count the drawn tokens; the rows that finished now (at a stop token or at max_new_tokens)."""
        self.steps = self.steps + 1
        hit_stop = (sampled == self.stop_ids).any(dim=1)
        self.hit_stop = hit_stop.tolist()
        return hit_stop | (self.steps >= self.max_new)

    def selected(self, keep: torch.Tensor) -> _Batch:
        """The rows of `keep`, without the leading columns no kept row attends to."""
        rows = keep.nonzero().squeeze(1)
        attention = self.attention[rows]
        first = int((attention.sum(dim=0) > 0).int().argmax()) if rows.numel() else 0
        layers = [(layer.keys[rows, :, first:], layer.values[rows, :, first:]) for layer in self.cache.layers]
        kept = [self.sequences[i] for i in rows.tolist()]
        return _Batch(
            kept,
            DynamicCache(layers),
            attention[:, first:],
            logits_versions=[self.logits_versions[i] for i in rows.tolist()],
            **{name: getattr(self, name)[rows] for name in self.ROW_TENSORS},
        )

    def joined(self, other: _Batch) -> _Batch:
        """This batch and `other` as one: the shorter cache left-padded to the longer, rows stacked."""
        width = max(self.attention.shape[1], other.attention.shape[1])

        def padded(tensor: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - tensor.shape[dim]
            if not missing:
                return tensor
            shape = list(tensor.shape)
            shape[dim] = missing
            return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

        layers = [
            (torch.cat([padded(a.keys, 2), padded(b.keys, 2)]), torch.cat([padded(a.values, 2), padded(b.values, 2)]))
            for a, b in zip(self.cache.layers, other.cache.layers, strict=True)
        ]
        stops = max(self.stop_ids.shape[1], other.stop_ids.shape[1])

        def stacked(name: str) -> torch.Tensor:
            mine, theirs = getattr(self, name), getattr(other, name)
            if name == "stop_ids":
                mine, theirs = (torch.nn.functional.pad(t, (0, stops - t.shape[1]), value=-1) for t in (mine, theirs))
            return torch.cat([mine, theirs])

        return _Batch(
            [*self.sequences, *other.sequences],
            DynamicCache(layers),
            torch.cat([padded(self.attention, 1), padded(other.attention, 1)]),
            logits_versions=[*self.logits_versions, *other.logits_versions],
            **{name: stacked(name) for name in self.ROW_TENSORS},
        )


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (per row)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors; products wrap, and the mask keeps the low 32 bits."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _row_keys(seeds: torch.Tensor) -> torch.Tensor:
    return _mix32(_mix32(seeds) ^ ((seeds >> 32) & _MASK32))


def _uniform(row_keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A uniform in [0, 1) per row, a function of (row seed, the row's token count) only: counter-based, so
    batch-independent."""
    bits = _mix32(row_keys ^ _mix32(steps + 0x9E3779B9))
    return (bits >> 8).double() / float(1 << 24)


def _sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row: the first token whose cumulative mass exceeds u * total."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniform.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1)
