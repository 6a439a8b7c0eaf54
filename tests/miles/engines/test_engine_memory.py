"""The TorchEngine gives its memory back for a colocated train step and takes it back for the push (release_memory /
resume_memory, as SGLang's memory saver): what it frees, what it refuses while released, and that the push after the
resume serves what it served before."""

from __future__ import annotations

import threading

import pytest
import torch

from miles.engines.torch_engine import TorchEngine
from tests.helpers import perturbed_weights
from tests.helpers.samples import make_requests, seeded
from tests.helpers.waiting import eventually


@pytest.fixture
def engine(tiny_model_dir):
    engine = TorchEngine(str(tiny_model_dir), weight_version=3, num_threads=1)
    yield engine
    engine.shutdown()


def _held_elements(engine: TorchEngine) -> int:
    return sum(parameter.numel() for parameter in engine.model.parameters())


def test_released_weights_free_their_storage_and_come_back_serving_the_pushed_weights(
    engine, tokenizer, tiny_model_dir
):
    requests = seeded(make_requests(tokenizer, ["12+34=", "5+5=", "9+1="]), 4)
    before = engine.generate(requests)
    weights = engine.model.state_dict()
    weights = {name: tensor.clone() for name, tensor in weights.items()}
    held = _held_elements(engine)

    engine.release_memory(["kv_cache", "weights"])
    assert _held_elements(engine) == 0  # every parameter's storage dropped, the tied head's with its embedding
    with pytest.raises(RuntimeError, match=r"released: resume_memory\(\['weights'\]\) before a push"):
        engine.update_weights(weights, 4)
    for refused in (lambda: engine.generate(requests), lambda: engine.sequence_logprobs([1, 2, 3])):
        with pytest.raises(RuntimeError, match=r"the engine's \['kv_cache', 'weights'\] memory is released"):
            refused()
    engine.release_memory(["weights"])  # again: nothing more to give

    engine.resume_memory(["weights"])
    assert _held_elements(engine) == held
    assert engine.model.get_output_embeddings().weight is engine.model.get_input_embeddings().weight
    engine.update_weights(weights, 4)
    with pytest.raises(RuntimeError, match=r"the engine's \['kv_cache'\] memory is released"):
        engine.generate(requests)
    engine.resume_memory(["kv_cache"])
    after = engine.generate(requests)
    assert [r.output_ids for r in after] == [r.output_ids for r in before]
    for now, then in zip(after, before, strict=True):
        assert now.logprobs == pytest.approx(then.logprobs, abs=1e-6)
    assert {r.weight_version for r in after} == {4}


def test_a_push_after_the_resume_serves_the_new_weights_not_the_old(engine, tokenizer, tiny_model_dir):
    new = perturbed_weights(tiny_model_dir, seed=1, scale=0.05)
    reference = TorchEngine(str(tiny_model_dir), weight_version=0, num_threads=1)
    try:
        reference.update_weights(new, 1)
        engine.release_memory(["kv_cache", "weights"])
        engine.resume_memory(["kv_cache", "weights"])
        engine.update_weights(new, 1)
        probe = list(range(1, 12))
        assert engine.sequence_logprobs(probe) == pytest.approx(reference.sequence_logprobs(probe), abs=1e-6)
        assert engine.weights_checksum() == reference.weights_checksum()
    finally:
        reference.shutdown()


def test_memory_is_released_only_while_no_request_is_in_flight_and_tags_are_checked(engine, tokenizer):
    with pytest.raises(
        ValueError, match=r"memory tags \['activations'\]: an engine releases \['kv_cache', 'weights'\]"
    ):
        engine.release_memory(["weights", "activations"])
    engine.pause_generation("in_place")  # a request in flight waits between two decode steps
    long = seeded(make_requests(tokenizer, ["1+1="], max_new_tokens=64), 0)
    results: list = []
    thread = threading.Thread(target=lambda: results.extend(engine.generate(long)))
    thread.start()
    try:
        assert eventually(lambda: engine._in_flight(), timeout_s=30)
        with pytest.raises(RuntimeError, match=r"release_memory needs an idle engine: 1 requests in flight"):
            engine.release_memory(["kv_cache"])
    finally:
        engine.continue_generation()
        thread.join(timeout=60)
    assert len(results) == 1
    engine.release_memory(["kv_cache"])  # idle now
    engine.resume_memory(["kv_cache"])
    assert engine.generate(long)[0].output_ids == results[0].output_ids


def test_an_engine_serving_adapters_keeps_its_base_weights(engine, tiny_model_dir):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    config = LoraConfig(r=2, target_modules=["q_proj"])
    adapter = get_peft_model_state_dict(get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config))
    engine.load_adapter("math", adapter, config.to_dict(), 1)
    with pytest.raises(ValueError, match="an engine serving LoRA adapters keeps its base weights"):
        engine.release_memory(["weights"])
    assert _held_elements(engine) > 0 and torch.isfinite(next(engine.model.parameters())).all()
