"""TorchEngine: per-request seeded sampling, and LoRA adapters served in mixed batches (peft)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.config import AdapterConfig
from miles.engines.torch_engine import TorchEngine
from tests.helpers.samples import ADAPTER_PROMPTS, make_requests, seeded, with_adapter


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """A base-only engine (no adapter is ever loaded on it)."""
    return TorchEngine(str(tiny_model_dir), weight_version=3, num_threads=1)


@pytest.fixture
def new_engine(tiny_model_dir):
    def make(**adapters):
        """An engine with the given adapters loaded: name=(tensors, config, version)."""
        engine = TorchEngine(str(tiny_model_dir), weight_version=3, num_threads=1)
        for name, (tensors, config, version) in adapters.items():
            engine.load_adapter(name, tensors, config, version)
        return engine

    return make


def _assert_same_samples(got, expected, atol=1e-5):
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.output_ids == e.output_ids
        assert g.finish_reason == e.finish_reason
        assert g.weight_version == e.weight_version
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=atol, rtol=0)


def _differs(a, b, atol=1e-4) -> bool:
    if a.output_ids != b.output_ids:
        return True
    return not torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0)


# --- sampling -------------------------------------------------------------------------------------------------


def test_a_request_samples_the_same_alone_and_inside_any_batch(engine, tokenizer):
    requests = seeded(make_requests(tokenizer, ADAPTER_PROMPTS * 3, max_new_tokens=6), 5)
    batched = engine.generate(requests)
    reversed_batch = engine.generate(requests[::-1])[::-1]
    _assert_same_samples(reversed_batch, batched)
    for i in (0, 3, 7, 11, 17):  # prompts of every length, so left padding differs between alone and batched
        _assert_same_samples(engine.generate([requests[i]]), [batched[i]])
    # Inside a batch of other prompts with other seeds, too.
    others = seeded(make_requests(tokenizer, ["77+77=", "2+"] * 5, max_new_tokens=6), 9)
    mixed = engine.generate(others[:5] + [requests[4]] + others[5:])
    _assert_same_samples([mixed[5]], [batched[4]])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_token_frequencies_match_the_reported_probabilities(engine, tokenizer, temperature):
    n = 4000
    prompt = tokenizer("12+")["input_ids"]  # the next token is the first digit of b: a spread-out distribution
    requests = make_requests(tokenizer, ["12+"] * n, max_new_tokens=1, temperature=temperature)
    results = engine.generate([dataclasses.replace(r, seed=1_000 + i) for i, r in enumerate(requests)])

    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    probs = torch.softmax(logits / temperature, dim=-1)
    assert probs.max() < 0.8, "the test needs a prompt with a spread-out next-token distribution"

    counts = Counter(r.output_ids[0] for r in results)
    for r in results:  # each reported log-prob is that of the sampled token under the temperature-scaled model
        assert r.logprobs[0] == pytest.approx(float(probs[r.output_ids[0]].log()), abs=1e-5)
    freq = torch.zeros_like(probs)
    for token, count in counts.items():
        freq[token] = count / n
    total_variation = 0.5 * float((freq - probs).abs().sum())
    assert total_variation < 0.05, (total_variation, counts)
    assert len(counts) >= 4


def test_different_seeds_give_different_samples(engine, tokenizer):
    base = make_requests(tokenizer, ["12+"] * 64, max_new_tokens=4)
    low = engine.generate([dataclasses.replace(r, seed=i) for i, r in enumerate(base)])
    high = engine.generate([dataclasses.replace(r, seed=i << 32) for i, r in enumerate(base)])  # only high bits differ
    for results in (low, high):
        assert len({tuple(r.output_ids) for r in results}) >= 16
    assert [r.output_ids for r in low] != [r.output_ids for r in high]
    # The same seed twice in one batch gives the same sample twice.
    twice = engine.generate([dataclasses.replace(base[0], seed=42)] * 2 + [dataclasses.replace(base[0], seed=43)])
    assert twice[0].output_ids == twice[1].output_ids and twice[0].logprobs == twice[1].logprobs


# --- adapters -------------------------------------------------------------------------------------------------


def test_mixed_adapter_batch_equals_one_batch_per_adapter(new_engine, make_lora, tokenizer):
    (ta, ca), (tb, cb) = make_lora(1), make_lora(2)
    engine = new_engine(a=(ta, ca, 10), b=(tb, cb, 20))
    assert engine.adapter_versions() == {"a": 10, "b": 20} and engine.weight_version() == 3
    plain = seeded(make_requests(tokenizer, ADAPTER_PROMPTS, max_new_tokens=6), 3)
    names = ["a", "b", None]
    mixed_requests = [dataclasses.replace(r, adapter=n) for r in plain for n in names]
    mixed = engine.generate(mixed_requests)
    alone = {n: engine.generate(with_adapter(plain, n)) for n in names}
    for j, name in enumerate(names):
        _assert_same_samples(mixed[j :: len(names)], alone[name])
    assert {r.weight_version for r in alone["a"]} == {10}
    assert {r.weight_version for r in alone["b"]} == {20}
    assert {r.weight_version for r in alone[None]} == {3}
    for i in range(len(plain)):  # every adapter row samples from its own weights, not the base's or the other's
        assert _differs(alone["a"][i], alone[None][i])
        assert _differs(alone["b"][i], alone[None][i])
        assert _differs(alone["a"][i], alone["b"][i])
    # The base rows of an engine serving adapters are those of an engine that never loaded one.
    _assert_same_samples(alone[None], new_engine().generate(plain))


@pytest.mark.parametrize("new_rank", [8, 4], ids=["same-config", "new-rank"])
def test_pushing_one_adapter_leaves_the_other_unchanged(new_engine, make_lora, tokenizer, new_rank):
    (ta, ca), (tb, cb) = make_lora(1), make_lora(2)
    engine = new_engine(a=(ta, ca, 1), b=(tb, cb, 1))
    plain = seeded(make_requests(tokenizer, ADAPTER_PROMPTS, max_new_tokens=6), 4)
    requests = [dataclasses.replace(r, adapter=n) for r in plain for n in ("a", "b")]
    before = engine.generate(requests)

    ta2, ca2 = make_lora(7, rank=new_rank)
    engine.load_adapter("a", ta2, ca2, 2)
    after = engine.generate(requests)

    assert engine.adapter_versions() == {"a": 2, "b": 1}
    # b: the same samples. Not bit for bit: a's new tokens end its rows at other steps, and the batch's shape
    # changes with them.
    _assert_same_samples(after[1::2], before[1::2])
    assert {r.weight_version for r in after[1::2]} == {1}
    assert all(_differs(old, new) for old, new in zip(before[::2], after[::2], strict=True))
    assert {r.weight_version for r in after[::2]} == {2}
    # The replaced adapter is exactly the new one: as on an engine that only ever loaded the new weights.
    _assert_same_samples(after[::2], new_engine(a=(ta2, ca2, 2)).generate(with_adapter(plain, "a")))


def test_unloaded_adapter_is_refused_by_name(new_engine, make_lora, tokenizer):
    (ta, ca), (tb, cb) = make_lora(1), make_lora(2)
    engine = new_engine(a=(ta, ca, 1), b=(tb, cb, 1))
    plain = seeded(make_requests(tokenizer, ADAPTER_PROMPTS[:3]), 0)
    before_a, before_base = engine.generate(with_adapter(plain, "a")), engine.generate(plain)
    engine.unload_adapter("b")
    assert engine.adapter_versions() == {"a": 1}
    with pytest.raises(ValueError, match="'b'"):
        engine.generate(with_adapter(plain, "b"))
    with pytest.raises(ValueError, match="'b'"):  # one unknown adapter in a mixed batch refuses the batch
        engine.generate(with_adapter(plain, "a") + with_adapter(plain[:1], "b"))
    _assert_same_samples(engine.generate(with_adapter(plain, "a")), before_a)
    _assert_same_samples(engine.generate(plain), before_base)
    engine.unload_adapter("b")  # unloading an adapter that is not loaded is a no-op
    assert engine.adapter_versions() == {"a": 1}


def test_unloading_the_first_loaded_adapter_keeps_the_others(new_engine, make_lora, tokenizer):
    (ta, ca), (tb, cb) = make_lora(1), make_lora(2)
    engine = new_engine(a=(ta, ca, 1), b=(tb, cb, 1))
    plain = seeded(make_requests(tokenizer, ADAPTER_PROMPTS[:3]), 0)
    before_b = engine.generate(with_adapter(plain, "b"))
    engine.unload_adapter("a")
    assert engine.adapter_versions() == {"b": 1}
    with pytest.raises(ValueError, match="'a'"):
        engine.generate(with_adapter(plain, "a"))
    _assert_same_samples(engine.generate(with_adapter(plain, "b")), before_b)


def test_unloading_every_adapter_serves_the_base_again(new_engine, make_lora, tokenizer):
    ta, ca = make_lora(1)
    engine = new_engine(a=(ta, ca, 1))
    plain = seeded(make_requests(tokenizer, ADAPTER_PROMPTS[:3]), 0)
    before = engine.generate(plain)
    engine.unload_adapter("a")
    assert engine.adapter_versions() == {}
    _assert_same_samples(engine.generate(plain), before)
    with pytest.raises(ValueError, match="'a'"):
        engine.generate(with_adapter(plain, "a"))


def test_update_weights_after_unloading_every_adapter(new_engine, make_lora, tiny_model_dir):
    ta, ca = make_lora(1)
    engine = new_engine(a=(ta, ca, 1))
    engine.unload_adapter("a")
    weights = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    engine.update_weights(weights, version=4)
    assert engine.weight_version() == 4


def test_requests_for_an_adapter_never_loaded_are_refused(engine, new_engine, make_lora, tokenizer):
    plain = seeded(make_requests(tokenizer, ADAPTER_PROMPTS[:2]), 0)
    with pytest.raises(ValueError, match="'nope'"):
        engine.generate(with_adapter(plain, "nope"))  # an engine without any adapter
    ta, ca = make_lora(1)
    with_a = new_engine(a=(ta, ca, 1))
    with pytest.raises(ValueError, match="'nope'"):
        with_a.generate(plain + with_adapter(plain, "nope"))


def test_update_weights_is_refused_while_adapters_are_loaded(new_engine, make_lora, tokenizer):
    ta, ca = make_lora(1)
    engine = new_engine(a=(ta, ca, 1))
    plain = seeded(make_requests(tokenizer, ADAPTER_PROMPTS[:3]), 0)
    before = engine.generate(plain)
    zeros = {k: torch.zeros_like(v) for k, v in engine.model.get_base_model().state_dict().items() if "lora_" not in k}
    with pytest.raises(ValueError):
        engine.update_weights(zeros, version=9)
    assert engine.weight_version() == 3
    _assert_same_samples(engine.generate(plain), before)


def test_load_adapter_refuses_tensors_that_do_not_match_the_config(new_engine, make_lora):
    ta, ca = make_lora(1)
    missing = dict(list(ta.items())[1:])
    engine = new_engine()
    with pytest.raises(ValueError, match="'a'"):
        engine.load_adapter("a", missing, ca, 1)
    assert "a" not in engine.adapter_versions()


@pytest.mark.parametrize("name", ["addition", "b2", "mlp", "norm"])
def test_any_valid_adapter_name_loads_and_serves(new_engine, make_lora, tokenizer, name):
    AdapterConfig(name=name)  # a name the config accepts
    ta, ca = make_lora(1)
    engine = new_engine()
    engine.load_adapter(name, ta, ca, 5)
    plain = seeded(make_requests(tokenizer, ADAPTER_PROMPTS[:2]), 0)
    _assert_same_samples(
        engine.generate(with_adapter(plain, name)), new_engine(a=(ta, ca, 5)).generate(with_adapter(plain, "a"))
    )
