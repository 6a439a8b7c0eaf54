"""TorchEngine: batched sampling with a KV cache on a transformers causal LM, CPU or CUDA.

LoRA adapters are served with peft: every loaded adapter sits on the one base model, and a batch may mix
requests of several adapters (and of the base), each row running through its own adapter.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

from miles.engines.base import GenerateRequest, GenerateResult, check_adapters_loaded, read_safetensors
from miles.train.lora import is_adapter_key
from miles.weight_group import Membership, TensorSpec, WeightGroup, first_rows, receive_bucket

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch
_MASK32 = 0xFFFFFFFF


class TorchEngine:
    def __init__(self, model_dir: str, weight_version: int = 0, device: str = "cpu", num_threads: int | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device).eval()
        self.pad_token_id = self.model.config.pad_token_id or 0
        self._weight_version = weight_version
        self._adapter_versions: dict[str, int] = {}
        self._weight_group = Membership()

    def weight_version(self) -> int:
        return self._weight_version

    def adapter_versions(self) -> dict[str, int]:
        return dict(self._adapter_versions)

    @torch.no_grad()  # not inference_mode: peft flips requires_grad on adapter tensors when one is deleted
    def load_adapter(self, name: str, named_tensors: dict[str, torch.Tensor], config: dict, version: int) -> None:
        """Load (or replace) LoRA adapter `name` from its PEFT state dict and adapter_config.json contents."""
        lora = LoraConfig(**{k: v for k, v in config.items() if k in LoraConfig.__dataclass_fields__})
        if not isinstance(self.model, PeftModel):
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
                f"adapter {name!r}: tensors do not match its config (missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})"
            )
        self.model.eval()
        self._adapter_versions[name] = version

    def unload_adapter(self, name: str) -> None:
        if name not in self._adapter_versions:
            return
        del self._adapter_versions[name]
        if self._adapter_versions:
            self.model.delete_adapter(name)
        else:  # the last one: back to the plain base model, which takes full weight pushes again
            self.model = self.model.unload().eval()

    def health(self) -> bool:
        return True

    def shutdown(self) -> None:
        del self.model

    @torch.inference_mode()
    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        if self._adapter_versions:
            raise ValueError("the base weights of an engine serving LoRA adapters are frozen; push adapters instead")
        self.model.load_state_dict(named_tensors, strict=True)
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
    ) -> dict[str, list | None]:
        """Receive the weights broadcast over the weight-update `group` (joined as `rank_offset` when new), bucket
        by bucket, into the model: tensor by tensor straight into the parameters, or as flattened buckets. A failed
        broadcast leaves the weights partly updated (as SGLang's do) until the next push lands. Returns the first row of each received tensor as the model now holds it (None
        for a name the model does not have), for the sender to check."""
        if self._adapter_versions:
            raise ValueError("the base weights of an engine serving LoRA adapters are frozen; push adapters instead")
        process_group = self._weight_group.of(group, rank_offset)
        parameters = self.model.state_dict()
        for specs in buckets:  # every bucket is received, whatever it holds, so the broadcast stays in step
            for name, tensor in receive_bucket(process_group, specs, self.device, load_format, parameters).items():
                if name in parameters and tensor is not parameters[name]:
                    parameters[name].copy_(tensor)
        self._weight_version = version
        names = [name for specs in buckets for name, _, _ in specs]
        held = first_rows({name: parameters[name] for name in names if name in parameters})
        return {name: held.get(name) for name in names}

    def _adapter_kwargs(self, requests: list[GenerateRequest]) -> dict:
        check_adapters_loaded(requests, self._adapter_versions)
        if not isinstance(self.model, PeftModel):
            return {}
        return {"adapter_names": [r.adapter or BASE_ADAPTER for r in requests]}

    @torch.inference_mode()
    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        if not requests:
            return []
        adapters = self._adapter_kwargs(requests)
        batch = len(requests)
        dev = self.device
        prompt_lens = torch.tensor([len(r.prompt_ids) for r in requests])
        width = int(prompt_lens.max())
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding, so every row's next token sits in the last column
            input_ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids) :] = 1
        # Temperature 0 is greedy decoding, as in SGLang: the most likely token, its log-prob at temperature 1.
        greedy = torch.tensor([r.sampling.temperature == 0 for r in requests], device=dev).unsqueeze(1)
        temperature = torch.tensor([r.sampling.temperature or 1.0 for r in requests], device=dev).unsqueeze(1)
        top_p = torch.tensor([r.sampling.top_p for r in requests], device=dev).unsqueeze(1)
        max_new = torch.tensor([r.sampling.max_new_tokens for r in requests], device=dev)
        max_stops = max(1, max(len(r.sampling.stop_token_ids) for r in requests))
        stop_ids = torch.full((batch, max_stops), -1, dtype=torch.long)
        for i, r in enumerate(requests):
            stop_ids[i, : len(r.sampling.stop_token_ids)] = torch.tensor(r.sampling.stop_token_ids, dtype=torch.long)
        stop_ids = stop_ids.to(dev)
        needs_top_p = bool((top_p < 1.0).any())
        row_keys = _row_keys(torch.tensor([r.seed for r in requests], dtype=torch.long)).to(dev)

        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **adapters,
        )
        cache, logits = out.cache, out.logits[:, -1]
        next_pos = positions[:, -1:] + 1

        steps = int(max_new.max())
        tokens = torch.full((batch, steps), self.pad_token_id, dtype=torch.long, device=dev)
        logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=dev)
        lengths = torch.zeros(batch, dtype=torch.long, device=dev)
        stopped = torch.zeros(batch, dtype=torch.bool, device=dev)
        done = torch.zeros(batch, dtype=torch.bool, device=dev)
        for step in range(steps):
            step_logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
            probs = step_logprobs.exp()
            if needs_top_p:
                probs = _top_p_filter(probs, top_p)
            sampled = _sample(probs, _uniform(row_keys, step))
            sampled = torch.where(greedy, step_logprobs.argmax(dim=-1, keepdim=True), sampled)
            active = ~done
            tokens[:, step] = torch.where(active, sampled.squeeze(1), self.pad_token_id)
            logprobs[:, step] = torch.where(active, step_logprobs.gather(1, sampled).squeeze(1), 0.0)
            lengths += active.long()
            hit_stop = (sampled == stop_ids).any(dim=1) & active
            stopped |= hit_stop
            done |= hit_stop | (lengths >= max_new)
            if bool(done.all()):
                break
            attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype, device=dev)], dim=1)
            out = self.model(
                input_ids=sampled,
                attention_mask=attention,
                position_ids=next_pos,
                cache=cache,
                use_cache=True,
                **adapters,
            )
            cache, logits = out.cache, out.logits[:, -1]
            next_pos = next_pos + 1

        tokens_list, logprobs_list = tokens.cpu().tolist(), logprobs.cpu().tolist()
        lengths_list, stopped_list = lengths.cpu().tolist(), stopped.cpu().tolist()
        return [
            GenerateResult(
                output_ids=tokens_list[i][: lengths_list[i]],
                logprobs=logprobs_list[i][: lengths_list[i]],
                finish_reason="stop" if stopped_list[i] else "length",
                weight_version=self._adapter_versions[r.adapter] if r.adapter else self._weight_version,
            )
            for i, r in enumerate(requests)
        ]


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


def _uniform(row_keys: torch.Tensor, step: int) -> torch.Tensor:
    """A uniform in [0, 1) per row, a function of (row seed, step) only: counter-based, so batch-independent."""
    bits = _mix32(row_keys ^ _mix32(torch.full_like(row_keys, step + 0x9E3779B9)))
    return (bits >> 8).double() / float(1 << 24)


def _sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row: the first token whose cumulative mass exceeds u * total."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniform.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1)
