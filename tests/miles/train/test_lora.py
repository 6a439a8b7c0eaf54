"""LoRATrainActor in-process (no Ray): per-adapter training, ledger, PEFT checkpoints the engine agrees with."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from miles.config import AdapterConfig
from miles.engines.torch_engine import TorchEngine
from miles.state.run_dir import RunDir
from miles.train.batch import batch_from_table
from miles.train.lora import LoRATrainActor, is_adapter_key
from miles.train.update import batch_logprobs
from tests.helpers.samples import grpo_advantages, make_requests, seeded, training_table

PROMPTS = [f"{a}+{a + 3}=" for a in range(8)] * 2


@pytest.fixture(scope="module")
def rollout(tiny_model_dir, tokenizer):
    requests = make_requests(tokenizer, PROMPTS)
    results = TorchEngine(str(tiny_model_dir), num_threads=1).generate(seeded(requests, 11))
    torch.manual_seed(0)
    rewards = torch.rand(len(results), dtype=torch.float64)
    advantages = grpo_advantages(rewards, results)
    return training_table(requests, results, advantages)


@pytest.fixture
def make_actor(small_config, tiny_model_dir, tmp_path):
    """A LoRATrainActor with the named adapters, each with its own view (run dir tmp_path/<name><suffix>)."""

    def make(*names: str, suffix: str = "", checkpoint: str | None = None, lr: float = 1e-2):
        actor = LoRATrainActor(small_config(), str(tiny_model_dir))
        views = {}
        for name in names:
            views[name] = small_config(f"train.lr={lr}", run_dir=str(tmp_path / f"{name}{suffix}"))
            actor.add_adapter(AdapterConfig(name=name), views[name], checkpoint=checkpoint)
        return actor, views

    return make


def _base_weights(actor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in actor.model.named_parameters() if "lora_" not in n}


def _assert_equal_dicts(got, expected):
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def _changed(got, expected) -> bool:
    return any(not torch.equal(got[k], v) for k, v in expected.items())


def test_training_one_adapter_changes_only_that_adapter(make_actor, rollout):
    actor, _ = make_actor("a", "b")
    a0, b0, base0 = actor.adapter_weights("a"), actor.adapter_weights("b"), _base_weights(actor)
    assert a0.keys() == b0.keys() and len(a0) > 0
    assert _changed(a0, b0)  # seeded by name: two adapters start from different lora_A

    metrics = actor.train("a", 0, rollout)
    assert metrics["optimizer_steps"] == 1
    assert _changed(actor.adapter_weights("a"), a0)
    _assert_equal_dicts(actor.adapter_weights("b"), b0)
    _assert_equal_dicts(_base_weights(actor), base0)

    a1 = actor.adapter_weights("a")
    actor.train("b", 0, rollout)  # and the other way round
    assert _changed(actor.adapter_weights("b"), b0)
    _assert_equal_dicts(actor.adapter_weights("a"), a1)
    _assert_equal_dicts(_base_weights(actor), base0)


def test_a_repeated_train_call_is_a_no_op_returning_the_recorded_metrics(make_actor, rollout, tmp_path):
    actor, views = make_actor("a", "b")
    first = actor.train("a", 0, rollout)
    after_first = actor.adapter_weights("a")
    again = actor.train("a", 0, rollout)
    assert again == first
    _assert_equal_dicts(actor.adapter_weights("a"), after_first)
    # Each adapter keeps its own record, and "b" has not trained rollout 0; the ledger on disk is the driver's to
    # write (miles.iterations), never the trainer's.
    assert list(actor.adapters["a"].trained) == [0] and list(actor.adapters["b"].trained) == []
    assert not any(RunDir(view.run_dir).ledger().path.exists() for view in views.values())
    b0 = actor.adapter_weights("b")
    actor.train("b", 0, rollout)
    assert _changed(actor.adapter_weights("b"), b0)


@pytest.fixture
def trained(make_actor, rollout):
    """An actor whose adapter "a" trained on rollout 0 and was saved, and the checkpoint dir."""
    actor, views = make_actor("a")
    actor.train("a", 0, rollout)
    return actor, views["a"], actor.save_checkpoint("a", 0, {"note": "x"})


def test_checkpoint_is_a_peft_directory_that_reproduces_the_engine_logprobs(trained, tiny_model_dir, tokenizer):
    actor, view, ckpt = trained
    ckpt = Path(ckpt)
    assert ckpt == Path(view.run_dir) / "checkpoints" / "0"
    adapter_dir = ckpt / "adapter"
    assert {p.name for p in adapter_dir.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((ckpt / "state.json").read_text())["rollout_id"] == 0
    _assert_equal_dicts(load_file(str(adapter_dir / "adapter_model.safetensors")), actor.adapter_weights("a"))

    engine = TorchEngine(str(tiny_model_dir), weight_version=0, num_threads=1)
    engine.load_adapter("a", actor.adapter_weights("a"), actor.adapter_config("a"), version=1)
    requests = [dataclasses.replace(r, adapter="a") for r in make_requests(tokenizer, PROMPTS, max_new_tokens=6)]
    results = engine.generate(seeded(requests, 21))
    assert {r.weight_version for r in results} == {1}
    batch = batch_from_table(training_table(requests, results), actor.pad_token_id)
    mask = batch.response_mask
    assert mask.sum() == sum(len(r.output_ids) for r in results) > 0

    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), adapter_dir
    )
    peft_model.eval()
    _assert_equal_dicts(get_peft_model_state_dict(peft_model), actor.adapter_weights("a"))
    peft_lp = batch_logprobs(peft_model, batch, view, torch.device("cpu"))
    torch.testing.assert_close(peft_lp[mask], batch.rollout_logprobs[mask], atol=1e-5, rtol=0)

    # The adapter matters: the base model gives other log-probs for the same tokens.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    base_lp = batch_logprobs(base, batch, view, torch.device("cpu"))
    assert (base_lp[mask] - peft_lp[mask]).abs().max() > 1e-3


def test_an_adapter_restored_from_its_checkpoint_continues_the_same_run(trained, make_actor, rollout):
    actor, _, ckpt = trained
    restored, _ = make_actor("a", suffix="-restored", checkpoint=ckpt)
    _assert_equal_dicts(restored.adapter_weights("a"), actor.adapter_weights("a"))
    fresh, _ = make_actor("a", suffix="-fresh")
    assert _changed(restored.adapter_weights("a"), fresh.adapter_weights("a"))
    # Weights and optimizer state both came back: the next rollout trains both actors to the same weights.
    actor.train("a", 1, rollout)
    restored.train("a", 1, rollout)
    got, expected = restored.adapter_weights("a"), actor.adapter_weights("a")
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=1e-6, rtol=1e-5)


def test_an_adapter_saved_and_restored_beside_another_keeps_its_optimizer_state(make_actor, rollout):
    """Only the active adapter's parameters are trainable; the others' optimizer state is saved and restored all the
    same (a multi-LoRA run saves an adapter while another trained last, and restores it after the first)."""
    actor, _ = make_actor("a", "b")
    actor.train("b", 0, rollout)
    actor.train("a", 0, rollout)  # "a" is the active adapter now
    ckpt = actor.save_checkpoint("b", 0, {})
    restored = LoRATrainActor(actor.config, actor.base_dir)
    restored.add_adapter(AdapterConfig(name="a"), actor.adapters["a"].config)
    restored.add_adapter(AdapterConfig(name="b"), actor.adapters["b"].config, checkpoint=ckpt)
    saved, loaded = actor.adapters["b"].optimizer.state, restored.adapters["b"].optimizer.state
    assert len(loaded) == len(saved) > 0
    actor.train("b", 1, rollout)
    restored.train("b", 1, rollout)
    _assert_equal_dicts(restored.adapter_weights("b"), actor.adapter_weights("b"))


def test_removed_adapter_is_gone(make_actor, rollout):
    actor, _ = make_actor("a", "b")
    b0 = actor.adapter_weights("b")
    actor.remove_adapter("a")
    assert "a" not in actor.model.peft_config and "a" not in actor.adapters
    _assert_equal_dicts(actor.adapter_weights("b"), b0)
    actor.train("b", 0, rollout)
    assert _changed(actor.adapter_weights("b"), b0)


def test_removing_the_active_adapter_warns_not_and_leaves_the_other_to_train(make_actor, rollout):
    actor, _ = make_actor("a", "b", suffix="-pair")
    actor.train("a", 0, rollout)  # "a" is now the active adapter
    assert actor.model.active_adapters == ["a"]
    b0 = actor.adapter_weights("b")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actor.remove_adapter("a")
    assert [str(w.message) for w in caught] == []

    assert list(actor.adapters) == ["b"] and list(actor.model.peft_config) == ["b"]
    assert not [n for n, _ in actor.model.named_parameters() if is_adapter_key(n, "a")]
    _assert_equal_dicts(actor.adapter_weights("b"), b0)

    metrics = actor.train("b", 0, rollout)
    assert metrics["optimizer_steps"] == 1
    alone, _ = make_actor("b", suffix="-alone")  # the same seeded start, never next to "a"
    _assert_equal_dicts(alone.adapter_weights("b"), b0)
    alone_metrics = alone.train("b", 0, rollout)
    assert {k: v for k, v in alone_metrics.items() if k != "train_seconds"} == {
        k: v for k, v in metrics.items() if k != "train_seconds"
    }
    _assert_equal_dicts(actor.adapter_weights("b"), alone.adapter_weights("b"))


def test_removing_the_last_adapter_warns_not(make_actor, rollout):
    actor, _ = make_actor("a", suffix="-last")
    actor.train("a", 0, rollout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actor.remove_adapter("a")
    assert [str(w.message) for w in caught] == [] and actor.adapters == {}
