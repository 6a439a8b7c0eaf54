"""The trainer group over Ray: FSDP2-sharded workers (gloo) make the update one unsharded worker makes."""

from __future__ import annotations

import pytest
import ray
import torch
from transformers import AutoTokenizer

from miles.engines.torch_engine import TorchEngine
from miles.state.run_dir import RunDir
from miles.train.actor import TrainActor
from miles.train.group import start_trainer_group
from miles.train.update import rank_rows
from tests.helpers import max_abs_diff
from tests.helpers.samples import grpo_advantages, make_requests, seeded, training_table
from tests.helpers.waiting import eventually


def test_rank_rows_deal_equal_counts_balanced_by_tokens():
    tokens = torch.tensor([5, 1, 9, 3, 7, 2, 8, 4])
    # Longest first: 9 (row 2), 8 (6), 7 (4), 5 (0), 4 (7), 3 (3), 2 (5), 1 (1), dealt 0, 1, 1, 0, 0, 1, 1, 0.
    first, second = rank_rows(tokens, 2)
    assert first.tolist() == [0, 1, 2, 7] and second.tolist() == [3, 4, 5, 6]
    assert (int(tokens[first].sum()), int(tokens[second].sum())) == (9 + 5 + 4 + 1, 8 + 7 + 3 + 2)


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    """48 samples of the tiny model with random group-normalised advantages: three global batches of 16."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    requests = make_requests(tokenizer, [f"{a}+{2 * a + 1}=" for a in range(12)] * 4, max_new_tokens=6)
    results = TorchEngine(str(tiny_model_dir), num_threads=1).generate(seeded(requests, 5))
    rewards = torch.rand(len(results), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    return training_table(requests, results, grpo_advantages(rewards, results))


def _trained(small_config, tiny_model_dir, run_dir, rollout, *overrides):
    """A trainer group of the config's train.num_workers trains once on the rollout: (its weights, its metrics)."""
    config = small_config(
        "rollout.rollout_batch_size=12",
        "train.micro_batch_size=4",
        "train.weight_bucket_mb=0.5",  # the tiny model's 1.6 MiB leave the trainer in several buckets
        *overrides,
        run_dir=str(run_dir),
    )
    RunDir(config.run_dir).create()
    trainers = start_trainer_group(config, tiny_model_dir, None)
    try:
        metrics = trainers.call(TrainActor.train, 0, rollout)
        return trainers.call(TrainActor.weights), metrics
    finally:
        trainers.kill()


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["algo.policy_loss=gspo", "algo.tis_level=sequence"],
        ["train.gradient_checkpointing=true"],
        # the ranks' token budgets need different micro-batch counts; the head runs 16 positions at a time
        ["train.micro_batch_size=8", "train.max_tokens_per_micro_batch=30", "train.logits_chunk_mb=0.001"],
    ],
    ids=["ppo_clip", "gspo", "gradient_checkpointing", "token_budget_chunked_head"],
)
def test_two_sharded_workers_equal_one_unsharded(ray_session, small_config, tiny_model_dir, tmp_path, rollout, options):
    single, m_single = _trained(small_config, tiny_model_dir, tmp_path / "one", rollout, *options)
    sharded, m_sharded = _trained(
        small_config, tiny_model_dir, tmp_path / "two", rollout, "train.num_workers=2", *options
    )

    initial = TorchEngine(str(tiny_model_dir), num_threads=1).model.state_dict()
    assert max_abs_diff(single, {k: initial[k] for k in single}) > 1e-4  # three Adam steps moved the weights
    gap = max_abs_diff(single, sharded)
    print(f"two workers vs one {gap:.2e}")
    assert gap < 1e-5
    assert m_single["optimizer_steps"] == m_sharded["optimizer_steps"] == 3
    for key in ("loss", "pg_loss", "entropy", "clip_fraction", "grad_norm", "train_rollout_logprob_abs_diff"):
        assert m_sharded[key] == pytest.approx(m_single[key], rel=1e-4, abs=1e-6), key


def test_a_sharded_bf16_models_checkpoint_resumes_unsharded_from_its_master_weights(
    ray_session, small_config, bf16_model_dir, tmp_path, rollout
):
    """Two FSDP2 workers save a bf16 model's checkpoint (each its shard of the fp32 master weights, beside the Adam
    state); one unsharded worker resumes from it holding exactly the weights the group held."""
    config = small_config("rollout.rollout_batch_size=12", "train.num_workers=2", run_dir=str(tmp_path))
    RunDir(config.run_dir).create()
    trainers = start_trainer_group(config, bf16_model_dir, None)
    try:
        trainers.call(TrainActor.train, 0, rollout)
        held = trainers.call(TrainActor.weights)
        checkpoint = trainers.call(TrainActor.save_checkpoint, 0, {})
    finally:
        trainers.kill()
    resumed = TrainActor(small_config(run_dir=str(tmp_path)), str(bf16_model_dir), checkpoint=checkpoint)
    assert max_abs_diff(resumed.weights(), held) == 0.0
    assert any(not torch.equal(v, v.bfloat16().float()) for v in held.values())  # more than the bf16 files hold


def test_bfloat16_compute_keeps_float32_weights_and_reports_the_logprob_gap(
    ray_session, small_config, tiny_model_dir, tmp_path, rollout
):
    weights, metrics = _trained(
        small_config, tiny_model_dir, tmp_path, rollout, "train.num_workers=2", "train.param_dtype=bfloat16"
    )
    assert {value.dtype for value in weights.values()} == {torch.float32}
    # The engine sampled in float32: the trainer's bfloat16 forward is measurably, not grossly, off.
    print(f"bf16 trainer vs fp32 engine: mean |log-prob gap| {metrics['train_rollout_logprob_abs_diff']:.4f}")
    assert 1e-4 < metrics["train_rollout_logprob_abs_diff"] < 0.1
    assert metrics["optimizer_steps"] == 3 and torch.isfinite(torch.tensor(metrics["loss"]))


def test_a_worker_that_cannot_see_the_run_directory_fails_at_start_with_why(
    ray_session, small_config, tiny_model_dir, tmp_path
):
    config = small_config(run_dir=str(tmp_path / "not-shared"))
    with pytest.raises(ray.exceptions.RayActorError, match="the run directory must be on storage that every node sees"):
        start_trainer_group(config, tiny_model_dir, None)
    # Its placement group is released; Ray reports the freed resources a moment later.
    assert eventually(lambda: ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"], every_s=0.2)
