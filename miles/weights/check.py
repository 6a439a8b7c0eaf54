"""Checking that a weight push landed, in two ways: the weights moved, and they are the trainer's.

An engine can report a load successful and not serve the weights sent: SGLang loads tensors by name and skips, with
a warning, every name its model does not know. Reading the weights back (SGLang's `/get_weights_by_name`) works only
for the model classes that implement it, which Qwen's do not. So a push is checked by what every engine can say:

- **The weights moved.** Each engine reports a checksum of the weights it serves (`RolloutEngine.weights_checksum`:
  SGLang's `/weights_checker`, a sha256 of every tensor); the trainer reports a fingerprint of what it pushes (a
  sample of every tensor, cast to the served dtype). When the trainer's fingerprint changed since the engines last
  loaded, an engine whose checksum did not change lost the push, however small the step: weights under names the
  model does not know, a push that went to another engine, a load of the old version. A step too small to change
  any sampled element in the served dtype asks for nothing (a bf16 weight moves only when its update crosses half
  a unit in the last place).
- **They are the trainer's.** The trainer scores a sequence with the weights it pushes, every engine scores it with
  the weights it then serves, and the two agree within `rollout.push_check_atol` (mean absolute difference per
  token). The sequence is the model's own greedy continuation of one fixed token (taken once by each trainer group,
  from the weights it starts from): likely tokens, whose log-probs a bf16 engine rounds by hundredths. Tokens the model finds unlikely (log-probs near -15) sit where bf16 logits round by
  whole tenths: on a real bf16 model (SmolLM2-135M-Instruct) served by SGLang on a CPU, a sequence striding through
  the vocabulary differed from the trainer's fp32 forward by 0.25 per token before any push, its greedy sequence by
  about 0.04 (docs/concepts.md, "The push check").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

PROBE_TOKENS = 16
PROBE_START = 1  # the fixed token the probe continues from: any id of any vocabulary
FINGERPRINT_SAMPLE = 4096  # elements of each tensor in the fingerprint


@dataclass(frozen=True)
class WeightProbe:
    """The trainer's log-probs of `token_ids[1:]`, each given the tokens before it, under the pushed weights; and
    `fingerprint`, what they are in the served dtype (None: not taken)."""

    token_ids: list[int]
    logprobs: list[float]
    atol: float
    fingerprint: str | None = None

    def check(self, served: list[float], engine: str, version: int) -> None:
        """Raise ValueError when `served` (an engine's log-probs of the same tokens) is not the trainer's."""
        if len(served) != len(self.logprobs):
            raise ValueError(
                f"{engine} scored {len(served)} tokens of the {len(self.logprobs)}-token push check of weights "
                f"version {version}"
            )
        gap = sum(abs(a - b) for a, b in zip(served, self.logprobs, strict=True)) / len(served)
        if not gap <= self.atol:  # a NaN fails too
            raise ValueError(
                f"{engine} reported weights version {version} loaded, but does not serve them: its log-probs of the "
                f"push-check sequence differ from the trainer's by {gap:.3g} per token (rollout.push_check_atol="
                f"{self.atol:g}); SGLang skips the tensor names its model does not know, so check that the trainer's "
                f"names are the model's"
            )

    def check_all(self, served: dict[int, list[float]], version: int) -> None:
        """`check` for each engine's log-probs (engine index -> its log-probs)."""
        for index, logprobs in sorted(served.items()):
            self.check(logprobs, f"engine {index}", version)

    def check_moved(self, held: str | None, before: dict[int, str | None], after: dict[int, str | None], version: int):
        """Raise ValueError naming each engine whose checksum stayed as it was (`before` -> `after`, engine index ->
        checksum; None: the engine cannot tell) while the pushed weights differ from those the engines held (`held`,
        the fingerprint of the last weights that landed; None: unknown, nothing asked)."""
        if held is None or self.fingerprint is None or held == self.fingerprint:
            return
        lost = [i for i in sorted(after) if after[i] is not None and after[i] == before.get(i)]
        if lost:
            raise ValueError(
                f"engines {lost} reported weights version {version} loaded, but the weights they serve did not change "
                f"(checksum {after[lost[0]][:12]}) while the trainer's did: the push was lost; SGLang skips the tensor "
                f"names its model does not know, so check that the trainer's names are the model's"
            )


@torch.no_grad()
def take_probe(
    model: torch.nn.Module, device: torch.device, atol: float, dtype: str, token_ids: list[int] | None = None
) -> WeightProbe:
    """The trainer's side of the push check of `model`'s weights as served in `dtype`: the log-probs of `token_ids`
    (unset: the model's greedy continuation of PROBE_START, PROBE_TOKENS forwards), in eval mode, and the fingerprint.
    Every rank of a sharded model calls it."""
    from torch.distributed.fsdp import FSDPModule

    from miles.train.logprobs import token_logprobs

    training = model.training
    model.eval()
    try:
        if token_ids is None:
            tokens = torch.tensor([[PROBE_START]], device=device)
            for _ in range(PROBE_TOKENS):
                next_token = model(input_ids=tokens).logits[:, -1].argmax(-1, keepdim=True)
                tokens = torch.cat([tokens, next_token], dim=1)
        else:
            tokens = torch.tensor([token_ids], device=device)
        logprobs = token_logprobs(model(input_ids=tokens).logits.float(), tokens)[0, 1:].tolist()
    finally:
        model.train(training)
        if isinstance(model, FSDPModule):  # a forward with no backward leaves the root's parameters gathered
            model.reshard()
    return WeightProbe(tokens[0].tolist(), logprobs, atol, model_fingerprint(model, dtype))


def model_fingerprint(model: torch.nn.Module, dtype: str) -> str:
    """A digest of FINGERPRINT_SAMPLE evenly spaced elements of each parameter (each rank's shard of it, the ranks'
    digests combined), cast to `dtype` as the engines receive them: it changes with any sampled element, at a cost
    independent of the model's size."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    cast = getattr(torch, dtype)
    samples = []
    for name, parameter in model.named_parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        flat = local.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLE)][:FINGERPRINT_SAMPLE]
        samples.append((name, sample.to(cast).cpu().contiguous().view(torch.uint8).numpy().tobytes()))
    digest = fingerprint(samples)
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, digest)
        digest = fingerprint((str(rank), part.encode()) for rank, part in enumerate(every))
    return digest


def fingerprint(samples: Iterable[tuple[str, bytes]]) -> str:
    """A digest of (tensor name, sampled bytes) pairs, in their order."""
    digest = hashlib.sha256()
    for name, data in samples:
        digest.update(name.encode())
        digest.update(data)
    return digest.hexdigest()


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """An engine's `weights_checksum`: a digest of every tensor, in name order; the bytes' sha256 on the host (as SGLang
    hashes a CPU tensor), `device_sum` on a GPU (nothing copied to the host, as SGLang's GPU hash)."""
    parts = []
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        flat = tensor.detach().contiguous().reshape(-1)
        if flat.is_cuda:
            parts.append((name, device_sum(flat).to_bytes(8, "little", signed=True)))
        else:
            parts.append((name, flat.view(torch.uint8).numpy().tobytes()))
    return fingerprint(parts)


def device_sum(flat: torch.Tensor) -> int:
    """The sum of every element's bits times an odd multiplier of its position, modulo 2**64, computed where the
    tensor lives, CHECKSUM_CHUNK elements at a time. Any one element that changes changes the sum (its bits'
    difference times an odd number is never a multiple of 2**64); several changes cancel only by chance."""
    bits = flat.view(_SAME_WIDTH_INTEGER[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), CHECKSUM_CHUNK):
        chunk = bits[start : start + CHECKSUM_CHUNK].to(torch.int64)
        positions = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=flat.device)
        total += (chunk * (positions * _MULTIPLIER_STEP + 1 | 1)).sum()
    return int(total)


CHECKSUM_CHUNK = 1 << 24
_MULTIPLIER_STEP = 0x9E3779B97F4A7C15 - (1 << 64)  # the golden ratio's 64 bits, as a signed int64: positions spread
_SAME_WIDTH_INTEGER = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
