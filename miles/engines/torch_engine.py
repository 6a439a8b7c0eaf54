"""TorchEngine: batched sampling with a KV cache on a transformers causal LM, CPU or CUDA."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from miles.engines.base import GenerateRequest, GenerateResult


class TorchEngine:
    def __init__(self, model_dir: str, weight_version: int = 0, device: str = "cpu", num_threads: int | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device).eval()
        self.pad_token_id = self.model.config.pad_token_id or 0
        self._weight_version = weight_version

    def weight_version(self) -> int:
        return self._weight_version

    def health(self) -> bool:
        return True

    def shutdown(self) -> None:
        del self.model

    @torch.inference_mode()
    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(named_tensors, strict=True)
        self._weight_version = version

    @torch.inference_mode()
    def generate(self, requests: list[GenerateRequest], seed: int) -> list[GenerateResult]:
        if not requests:
            return []
        batch = len(requests)
        dev = self.device
        prompt_lens = torch.tensor([len(r.prompt_ids) for r in requests])
        width = int(prompt_lens.max())
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding, so every row's next token sits in the last column
            input_ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids) :] = 1
        temperature = torch.tensor([r.sampling.temperature for r in requests], device=dev).unsqueeze(1)
        top_p = torch.tensor([r.sampling.top_p for r in requests], device=dev).unsqueeze(1)
        max_new = torch.tensor([r.sampling.max_new_tokens for r in requests], device=dev)
        max_stops = max(1, max(len(r.sampling.stop_token_ids) for r in requests))
        stop_ids = torch.full((batch, max_stops), -1, dtype=torch.long)
        for i, r in enumerate(requests):
            stop_ids[i, : len(r.sampling.stop_token_ids)] = torch.tensor(r.sampling.stop_token_ids, dtype=torch.long)
        stop_ids = stop_ids.to(dev)
        needs_top_p = bool((top_p < 1.0).any())
        generator = torch.Generator(device=dev).manual_seed(seed)

        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1)
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
            sampled = torch.multinomial(probs, 1, generator=generator)
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
                input_ids=sampled, attention_mask=attention, position_ids=next_pos, cache=cache, use_cache=True
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
                weight_version=self._weight_version,
            )
            for i in range(batch)
        ]


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (per row)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
