"""TrainActor in-process (no Ray): options of the update and gradient accumulation."""

import pytest
import torch
from transformers import AutoTokenizer

from miles.engines.torch_engine import TorchEngine
from miles.train.actor import TrainActor
from miles.train.advantages import grpo_advantages
from tests.miles.engines.test_torch_engine import _requests, _table


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    requests = _requests(tokenizer, [f"{a}+{a + 3}=" for a in range(8)] * 2)
    results = TorchEngine(str(tiny_model_dir), num_threads=1).generate(requests, seed=11)
    torch.manual_seed(0)
    rewards = torch.rand(len(results)).numpy()
    advantages = grpo_advantages(rewards, torch.arange(len(results)).numpy() // 4).tolist()
    return _table(requests, results, advantages)


def _actor(small_config, tiny_model_dir, tmp_path, *overrides):
    return TrainActor(small_config(*overrides, run_dir=str(tmp_path)), str(tiny_model_dir))


def test_micro_batches_accumulate_to_the_full_batch_update(small_config, tiny_model_dir, tmp_path, rollout):
    whole = _actor(small_config, tiny_model_dir, tmp_path / "a", "train.micro_batch_size=16")
    split = _actor(small_config, tiny_model_dir, tmp_path / "b", "train.micro_batch_size=4")
    m_whole, m_split = whole.train(0, rollout), split.train(0, rollout)
    for name, value in whole.weights().items():
        torch.testing.assert_close(split.weights()[name], value, atol=2e-6, rtol=1e-5)
    assert m_whole["optimizer_steps"] == m_split["optimizer_steps"] == 1
    assert m_whole["loss"] == pytest.approx(m_split["loss"], abs=1e-6)


def test_passes_multiply_optimizer_steps(small_config, tiny_model_dir, tmp_path, rollout):
    metrics = _actor(small_config, tiny_model_dir, tmp_path, "train.num_passes=3").train(0, rollout)
    assert metrics["optimizer_steps"] == 3
    assert metrics["clip_fraction"] >= 0.0 and metrics["entropy"] > 0.0


def test_kl_loss_to_the_frozen_reference(small_config, tiny_model_dir, tmp_path, rollout):
    actor = _actor(small_config, tiny_model_dir, tmp_path, "algo.use_kl_loss=true", "algo.kl_loss_coef=0.5", "train.num_passes=2")
    metrics = actor.train(0, rollout)
    # The first pass starts at the reference (KL 0); the second has moved away from it.
    assert 0.0 < metrics["kl_ref"] < 0.1
    assert all(not p.requires_grad for p in actor.ref_model.parameters())


def test_rollout_logprobs_as_the_old_policy(small_config, tiny_model_dir, tmp_path, rollout):
    metrics = _actor(small_config, tiny_model_dir, tmp_path, "algo.use_rollout_logprobs=true").train(0, rollout)
    # On-policy in fp32 the engine's log-probs are the trainer's: nothing is clipped on the first step.
    assert metrics["clip_fraction"] == 0.0
    assert metrics["train_rollout_logprob_abs_diff"] < 1e-5
