"""The push check on a real pretrained model served by the real SGLang server: SmolLM2-135M-Instruct (bf16, tied
embeddings, 49k vocabulary; `make real-model`) on SGLang 0.5.23 on this CPU (`make install-sglang-cpu`), serving
bf16 as it would on a GPU.

The pushed weights are one Adam step away from the model's: each parameter moves by lr * sign(gradient), what
Adam's first update is, at lr 1e-6 (the preset for a real model), which changes about 0.4% of the bf16 weights. A
step that small moves the log-probs less than the engine's own bf16 rounding does, so only the checksums can tell a
lost push from a healthy one: these tests show both halves of the check at work.
"""

from __future__ import annotations

import os

import pytest
import torch

from miles.config import RolloutConfig, SGLangConfig
from miles.engines.sglang_engine import SGLangEngine
from miles.weights.check import WeightProbe
from miles.weights.group import FLATTENED
from miles.weights.payload import serialize_bucket
from tests.helpers import weights_directory, weights_probe
from tests.helpers.weight_sender import Sender, bucket_specs, in_buckets, new_group

pytestmark = pytest.mark.sglang_contract

REAL_PYTHON = os.environ.get("MILES_SGLANG_PYTHON")
LR = 1e-6
PUSH_CHECK_ATOL = RolloutConfig().push_check_atol


@pytest.fixture(scope="module")
def server(real_model_dir):
    if not REAL_PYTHON:
        pytest.skip("the real SGLang server needs MILES_SGLANG_PYTHON (make install-sglang-cpu; make test sets it)")
    config = SGLangConfig(python=REAL_PYTHON, health_timeout_s=30, startup_timeout_s=300)
    engine = SGLangEngine(str(real_model_dir), weight_version=0, device="cpu", dtype="bfloat16", config=config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def steps(real_model_dir):
    """Three successive Adam-sized steps of the model's float32 weights (the trainer's master weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    weights, found = {k: v.detach().clone() for k, v in model.state_dict().items()}, []
    for _ in range(3):
        for name, value in weights.items():
            if name != "lm_head.weight":  # tied to the embedding, which moves it
                value -= LR * torch.sign(torch.randn(value.shape, generator=generator))
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        found.append({k: v.clone() for k, v in weights.items()})
    return found


def _served(weights: dict) -> dict:
    """As the trainer pushes them: bf16, the tied output head once (as its embedding)."""
    return {k: v.to(torch.bfloat16) for k, v in weights.items() if k != "lm_head.weight"}


def _check(server, probe: WeightProbe, held: str | None, before: str, version: int) -> None:
    after = server.weights_checksum()
    probe.check_moved(held, {0: before}, {0: after}, version)
    probe.check(server.sequence_logprobs(probe.token_ids), "engine 0", version)


def _probe(real_model_dir, weights) -> WeightProbe:
    return weights_probe(real_model_dir, weights, atol=PUSH_CHECK_ATOL, dtype="bfloat16")


def test_healthy_pushes_by_every_transport_pass_and_their_gaps_are_bf16_rounding(
    server, real_model_dir, steps, tmp_path
):
    """Pins: the bf16 server's log-probs of the trainer's probe are within the tolerance of the trainer's float32
    forward, and its checksum moves with every push, by disk, tensor and distributed alike."""
    from transformers import AutoModelForCausalLM

    start = _probe(real_model_dir, AutoModelForCausalLM.from_pretrained(real_model_dir).float().state_dict())
    start.check(server.sequence_logprobs(start.token_ids), "engine 0", 0)  # the served model before any push
    held, gaps = start.fingerprint, []
    for version, (transport, weights) in enumerate(zip(("disk", "tensor", "distributed"), steps, strict=True), 1):
        probe, before, served = _probe(real_model_dir, weights), server.weights_checksum(), _served(weights)
        if transport == "disk":
            server.update_weights_from_disk(
                str(weights_directory(real_model_dir, served, tmp_path / str(version))), version
            )
        elif transport == "tensor":
            server.update_weights_from_tensor([serialize_bucket(b)[0] for b in in_buckets(served, 4)], version)
        else:
            buckets = in_buckets(served, 4)
            sender = Sender(new_group())
            try:
                sender.send(buckets, FLATTENED)
                server.update_weights_from_distributed(sender.group, 1, bucket_specs(buckets), version, FLATTENED)
                sender.wait()
            finally:
                sender.close()
        _check(server, probe, held, before, version)
        served_logprobs = server.sequence_logprobs(probe.token_ids)
        gaps.append(
            sum(abs(a - b) for a, b in zip(served_logprobs, probe.logprobs, strict=True)) / len(served_logprobs)
        )
        held = probe.fingerprint
    assert server.weight_version() == 3
    print(f"healthy push gaps per token (disk, tensor, distributed): {gaps}")


def test_a_lost_push_fails_though_its_logprobs_are_within_rounding(server, real_model_dir, steps, tmp_path):
    """Pins: weights under names the model does not know are skipped by the load, which succeeds; the served weights'
    checksum does not move, and the check says the push was lost. Their log-probs alone cannot tell: the step is
    smaller than bf16 rounding. A push of the version the engine already holds, under a new version number (a
    stale version), fails alike."""
    base = _served(steps[0])
    server.update_weights_from_disk(str(weights_directory(real_model_dir, base, tmp_path / "base")), 10)
    held = _probe(real_model_dir, steps[0]).fingerprint
    probe = _probe(real_model_dir, steps[1])
    prefixed = {f"module.{k}": v for k, v in _served(steps[1]).items()}
    before = server.weights_checksum()
    server.update_weights_from_disk(str(weights_directory(real_model_dir, prefixed, tmp_path / "lost")), 11)
    probe.check(server.sequence_logprobs(probe.token_ids), "engine 0", 11)  # within rounding: log-probs cannot tell
    with pytest.raises(
        ValueError, match=r"engines \[0\] reported weights version 11 loaded, but the weights they serve"
    ):
        _check(server, probe, held, before, 11)
    before = server.weights_checksum()
    server.update_weights_from_disk(str(weights_directory(real_model_dir, base, tmp_path / "stale")), 12)
    with pytest.raises(ValueError, match="the push was lost"):
        _check(server, probe, held, before, 12)
