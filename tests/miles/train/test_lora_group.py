"""LoRA trainer groups over Ray: a frozen base sharded by FSDP2 (gloo) in the model's dtype, float32 adapters whole on
every worker, the same update as one unsharded worker, checkpoints that resume on another number of workers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from miles.config import AdapterConfig
from miles.engines.torch_engine import TorchEngine
from miles.state.run_dir import RunDir
from miles.train.group import start_worker_group
from miles.train.lora import LoRATrainActor
from tests.helpers import max_abs_diff, relative_distance
from tests.helpers.lora_memory import each_worker_held_bytes
from tests.helpers.samples import grpo_advantages, make_requests, seeded, training_table


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    """32 samples with random group-normalised advantages: two global batches of 16."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    requests = make_requests(tokenizer, [f"{a}+{a + 3}=" for a in range(8)] * 4, max_new_tokens=6)
    results = TorchEngine(str(tiny_model_dir), num_threads=1).generate(seeded(requests, 7))
    rewards = torch.rand(len(results), dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return training_table(requests, results, grpo_advantages(rewards, results))


def _group(small_config, model_dir, run_dir, *overrides, checkpoint=None):
    """A LoRA trainer group with adapter `tenant` (its view's run dir under `run_dir`), restored from `checkpoint`."""
    config = small_config(
        "rollout.rollout_batch_size=8",
        "rollout.n_samples_per_prompt=4",
        "train.global_batch_size=16",
        "train.micro_batch_size=4",
        "train.lr=1e-2",
        *overrides,
        run_dir=str(run_dir),
    )
    RunDir(config.run_dir).create()
    group = start_worker_group(config, LoRATrainActor, str(model_dir))
    group.call(LoRATrainActor.add_adapter, AdapterConfig(name="tenant"), config, checkpoint)
    return group


def _train(group, rollout, rollout_ids=(0,)):
    metrics = [group.call(LoRATrainActor.train, "tenant", i, rollout) for i in rollout_ids]
    return group.call(LoRATrainActor.adapter_weights, "tenant"), metrics[-1]


def test_two_sharded_workers_train_the_adapter_one_unsharded_worker_trains(
    ray_session, small_config, tiny_model_dir, tmp_path, rollout
):
    single = _group(small_config, tiny_model_dir, tmp_path / "one")
    sharded = _group(small_config, tiny_model_dir, tmp_path / "two", "train.num_workers=2")
    try:
        start = single.call(LoRATrainActor.adapter_weights, "tenant")
        assert max_abs_diff(start, sharded.call(LoRATrainActor.adapter_weights, "tenant")) == 0.0  # seeded alike
        (one, m_one), (two, m_two) = _train(single, rollout), _train(sharded, rollout)
        per_worker = each_worker_held_bytes(sharded)
        whole = each_worker_held_bytes(single)[0]
    finally:
        single.kill()
        sharded.kill()
    assert max_abs_diff(one, start) > 1e-3  # two Adam steps moved the adapter
    gap = relative_distance(two, one, start)
    print(f"two workers vs one: {gap:.2e} of the distance moved")
    assert gap < 1e-3
    for key in ("loss", "pg_loss", "grad_norm", "optimizer_steps"):
        assert m_two[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-6), key
    # Each worker holds half the base (FSDP2 shards, up to uneven splits) and the whole adapter with its Adam state.
    assert all(w["base"] < 0.6 * whole["base"] for w in per_worker)
    assert all(w["adapters"] == whole["adapters"] and w["optimizer"] == whole["optimizer"] for w in per_worker)


def test_a_bf16_base_sharded_over_two_workers_keeps_float32_adapters_and_resumes_on_one(
    ray_session, small_config, bf16_model_dir, tiny_model_dir, tmp_path, rollout
):
    """The base stays bf16 (a quarter of the fp32 bytes per worker of two); the adapter and its Adam state are fp32;
    the checkpoint two workers write resumes on one worker, which then steps as the group would have."""
    group = _group(small_config, bf16_model_dir, tmp_path / "two", "train.num_workers=2")
    try:
        saved, _ = _train(group, rollout)
        checkpoint = group.call(LoRATrainActor.save_checkpoint, "tenant", 0, {})
        held = each_worker_held_bytes(group)
        continued, _ = _train(group, rollout, rollout_ids=(1,))
    finally:
        group.kill()
    fp32 = _group(small_config, tiny_model_dir, tmp_path / "fp32")  # the same model in float32, unsharded
    resumed = _group(small_config, bf16_model_dir, tmp_path / "one", "train.sharding=none", checkpoint=checkpoint)
    try:
        _train(fp32, rollout)
        fp32_bytes = each_worker_held_bytes(fp32)[0]
        after_resume, _ = _train(resumed, rollout, rollout_ids=(1,))
    finally:
        fp32.kill()
        resumed.kill()
    # bf16 compute, sharded or not, rounds differently from machine to machine (the CPU's bf16 kernels), and Adam
    # turns a rounding-level gradient difference into a sizeable step on a weight whose gradient is near 0: compare
    # the step taken after the resume, over the whole adapter, with the group's (lost Adam moments would make it
    # another step altogether).
    gap = relative_distance(after_resume, continued, saved)
    print(f"resumed on one worker vs the group going on: {gap:.2e} of the step taken")
    assert gap < 1e-2
    assert all(h["base"] <= 0.3 * fp32_bytes["base"] for h in held)  # bf16 and halved
    assert all(h["adapters"] == fp32_bytes["adapters"] and h["optimizer"] == fp32_bytes["optimizer"] for h in held)
