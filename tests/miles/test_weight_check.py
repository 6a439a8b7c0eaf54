"""The push check's pieces (miles.weights.check): when a push counts as lost, and the digests it compares."""

from __future__ import annotations

import pytest
import torch

from miles.weights.check import WeightProbe, device_sum, model_fingerprint, take_probe, weights_checksum
from tests.helpers import small_llama


def _probe(fingerprint: str | None) -> WeightProbe:
    return WeightProbe([1, 2, 3], [-0.5, -0.25], atol=0.15, fingerprint=fingerprint)


def test_an_engine_whose_checksum_stays_while_the_trainers_fingerprint_moved_lost_the_push():
    with pytest.raises(
        ValueError, match=r"engines \[1\] reported weights version 7 loaded, but the weights they serve"
    ):
        _probe("new").check_moved("old", {0: "a", 1: "b"}, {0: "c", 1: "b"}, 7)


@pytest.mark.parametrize(
    "held, fingerprint, before, after",
    [
        ("same", "same", {0: "a"}, {0: "a"}),  # the trainer's weights did not change in the served dtype
        (None, "new", {0: "a"}, {0: "a"}),  # what the engines held is unknown (e.g. after a restart)
        ("old", None, {0: "a"}, {0: "a"}),  # a probe without a fingerprint
        ("old", "new", {0: None}, {0: None}),  # an engine that cannot tell
        ("old", "new", {0: "a"}, {0: "b"}),  # a push that moved the weights
    ],
)
def test_nothing_is_asked_where_nothing_can_be_told_and_a_moved_push_passes(held, fingerprint, before, after):
    _probe(fingerprint).check_moved(held, before, after, 1)


def test_the_logprob_half_takes_the_mean_gap_per_token_and_fails_a_nan():
    _probe(None).check([-0.6, -0.35], "engine 0", 1)  # gaps 0.1 and 0.1
    with pytest.raises(
        ValueError, match=r"differ from the trainer's by 0.2 per token \(rollout.push_check_atol=0.15\)"
    ):
        _probe(None).check([-0.7, -0.45], "engine 0", 1)
    with pytest.raises(ValueError, match="by nan per token"):
        _probe(None).check([float("nan"), -0.25], "engine 0", 1)


def _one_bit_up(tensor: torch.Tensor, position: int) -> torch.Tensor:
    changed = tensor.clone()
    bits = changed.view(-1).view(torch.int16)
    bits[position] += 1  # the next bf16 value: one unit in the last place
    return changed


def test_the_checksums_change_with_any_one_element_and_only_with_a_change():
    weights = torch.randn(300, 70).to(torch.bfloat16)
    moved = _one_bit_up(weights, 12345)
    assert weights_checksum([("w", weights)]) == weights_checksum([("w", weights.clone())])
    assert weights_checksum([("w", weights)]) != weights_checksum([("w", moved)])
    # the GPU's sum, run here on the CPU tensor: one unit in the last place, or two elements swapped, changes it
    swapped = weights.clone().view(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    flat = weights.view(-1)
    assert device_sum(flat) == device_sum(flat.clone())
    assert device_sum(flat) != device_sum(moved.view(-1)) and device_sum(flat) != device_sum(swapped)


def test_the_fingerprint_is_of_the_served_dtype_and_moves_with_a_sampled_element():
    model = small_llama()
    before = model_fingerprint(model, "bfloat16")
    parameter = model.model.embed_tokens.weight
    with torch.no_grad():
        parameter.view(-1)[0] += 1e-9  # below a bf16 unit in the last place: the served weights are the same
        assert model_fingerprint(model, "bfloat16") == before
        assert model_fingerprint(model, "float32") != model_fingerprint(small_llama(), "float32")
        parameter.view(-1)[0] += 0.5
    assert model_fingerprint(model, "bfloat16") != before


def test_the_probe_is_the_models_own_greedy_sequence_with_its_logprobs():
    model = small_llama()
    probe = take_probe(model, torch.device("cpu"), 0.15, "float32")
    assert len(probe.token_ids) == 17 and probe.token_ids[0] == 1 and len(probe.logprobs) == 16
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([probe.token_ids])).logits[0].log_softmax(-1)
    assert probe.token_ids[1:] == logits[:-1].argmax(-1).tolist()  # each token the likeliest after those before it
    torch.testing.assert_close(torch.tensor(probe.logprobs), logits[:-1].max(-1).values, atol=1e-5, rtol=0)
