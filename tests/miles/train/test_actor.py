"""TrainActor in-process (no Ray): options of the update and gradient accumulation."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from miles.engines.torch_engine import TorchEngine
from miles.state.run_dir import RunDir
from miles.train import actor as actor_module
from miles.train.actor import TrainActor
from miles.train.batch import batch_from_table
from miles.train.update import batch_logprobs
from miles.weights.group import FLATTENED
from tests.helpers.samples import grpo_advantages, make_requests, seeded, training_table
from tests.helpers.weight_sender import new_group


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    requests = make_requests(tokenizer, [f"{a}+{a + 3}=" for a in range(8)] * 2)
    results = TorchEngine(str(tiny_model_dir), num_threads=1).generate(seeded(requests, 11))
    torch.manual_seed(0)
    rewards = torch.rand(len(results), dtype=torch.float64)
    advantages = grpo_advantages(rewards, results)
    return training_table(requests, results, advantages)


def _actor(small_config, tiny_model_dir, tmp_path, *overrides):
    RunDir(tmp_path).create()
    return TrainActor(small_config(*overrides, run_dir=str(tmp_path)), str(tiny_model_dir))


@pytest.mark.parametrize(
    "algorithm",
    [
        [],  # ppo_clip, token_mean
        ["algo.policy_loss=gspo"],  # seq_mean_token_mean
        ["algo.policy_loss=cispo", "algo.loss_aggregation=seq_mean_token_sum"],
        ["algo.advantage_estimator=dr_grpo", "algo.tis_level=sequence"],  # seq_mean_token_sum_norm
    ],
    ids=["ppo_clip", "gspo", "cispo", "dr_grpo"],
)
@pytest.mark.parametrize(
    "split_by",
    [
        ["train.micro_batch_size=4"],
        ["train.micro_batch_size=5"],  # 5, 5, 5 and 1
        # 2 to 3 samples of about 9 tokens per micro-batch, as their lengths allow
        ["train.micro_batch_size=16", "train.max_tokens_per_micro_batch=24"],
        ["train.micro_batch_size=16", "train.max_tokens_per_micro_batch=1"],  # one sample each
    ],
    ids=["by_count", "uneven", "by_tokens", "one_each"],
)
def test_micro_batches_accumulate_to_the_full_batch_update(
    small_config, tiny_model_dir, tmp_path, rollout, algorithm, split_by
):
    """The aggregation's denominators are the global batch's: however the micro-batches split it (by count or by a
    token budget), the step is the same."""
    whole = _actor(small_config, tiny_model_dir, tmp_path / "a", "train.micro_batch_size=16", *algorithm)
    split = _actor(small_config, tiny_model_dir, tmp_path / "b", *split_by, *algorithm)
    m_whole, m_split = whole.train(0, rollout), split.train(0, rollout)
    # Adam's first step moves each weight by about lr (1e-3) times the sign of its gradient: a wrong accumulation
    # moves most weights by ~lr, while summation order alone can nudge an element whose gradient is ~0.
    for name, value in whole.weights().items():
        torch.testing.assert_close(split.weights()[name], value, atol=5e-5, rtol=1e-5)
    assert m_whole["optimizer_steps"] == m_split["optimizer_steps"] == 1
    assert m_whole["loss"] == pytest.approx(m_split["loss"], abs=1e-6)


def test_passes_multiply_optimizer_steps(small_config, tiny_model_dir, tmp_path, rollout):
    metrics = _actor(small_config, tiny_model_dir, tmp_path, "train.num_passes=3").train(0, rollout)
    assert metrics["optimizer_steps"] == 3
    assert metrics["clip_fraction"] >= 0.0 and metrics["entropy"] > 0.0


def test_kl_loss_pulls_the_policy_toward_the_frozen_reference(small_config, tiny_model_dir, tmp_path, rollout):
    batch = batch_from_table(rollout, 0)

    def drift(coef: float) -> tuple[dict, float]:
        actor = _actor(
            small_config,
            tiny_model_dir,
            tmp_path / str(coef),
            "algo.use_kl_loss=true",
            f"algo.kl_loss_coef={coef}",
            "train.num_passes=3",
        )
        metrics = actor.train(0, rollout)
        gap = batch_logprobs(actor.model, batch, actor.config, actor.device) - batch_logprobs(
            actor.ref_model, batch, actor.config, actor.device
        )
        assert all(not p.requires_grad for p in actor.ref_model.parameters())
        return metrics, float(gap[batch.response_mask].abs().mean())

    free, free_gap = drift(0.0)
    pulled, pulled_gap = drift(2.0)
    # The first pass starts at the reference; later passes have moved away from it, less so under the KL loss.
    assert free["kl_ref"] > 0.0 and pulled["kl_ref"] > 0.0
    assert 0.0 < pulled_gap < free_gap


def test_the_kl_in_reward_coefficient_adapts_to_the_kl_measured_on_earlier_rollouts(
    small_config, tiny_model_dir, tmp_path, rollout
):
    overrides = ["algo.kl_in_reward=true", "algo.kl_reward_coef=0.5", "algo.kl_reward_target=1e-9", "train.lr=0.05"]
    actor = _actor(small_config, tiny_model_dir, tmp_path, *overrides)
    first, second, third = (actor.train(i, rollout) for i in range(3))
    # Rollout 0 starts at the reference (KL 0, below the target: the error is clipped to -0.2, x0.98); rollout 1 is
    # trained by a policy that has left it (KL far above the target: +0.2, x1.02).
    assert first["kl_reward_coef"] == 0.5 and first["kl_in_reward"] == pytest.approx(0.0, abs=1e-9)
    assert second["kl_reward_coef"] == pytest.approx(0.5 * 0.98) and second["kl_in_reward"] > 1e-6
    assert third["kl_reward_coef"] == pytest.approx(0.5 * 0.98 * 1.02)
    assert actor.train(1, rollout) == second  # a retry gets the recorded rollout, coefficient and all


def test_rollout_logprobs_as_the_old_policy(small_config, tiny_model_dir, tmp_path, rollout):
    metrics = _actor(small_config, tiny_model_dir, tmp_path, "algo.use_rollout_logprobs=true").train(0, rollout)
    # On-policy in fp32 the engine's log-probs are the trainer's: nothing is clipped on the first step.
    assert metrics["clip_fraction"] == 0.0
    assert metrics["train_rollout_logprob_abs_diff"] < 1e-5


def test_a_broadcast_goes_in_the_dtype_the_engines_serve(small_config, tiny_model_dir, tmp_path, monkeypatch):
    """A bf16 engine gets the weights cast to bf16 on the trainer's side: half the bytes on the wire (what reaches
    the group is recorded here; the group itself is the contract suite's)."""
    actor = _actor(small_config, tiny_model_dir, tmp_path)
    specs = actor.weight_bucket_specs("bfloat16")
    assert {dtype for bucket in specs for _, dtype, _ in bucket} == {"bfloat16"}
    assert [[n for n, _, _ in b] for b in specs] == [[n for n, _, _ in b] for b in actor.weight_bucket_specs()]
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(actor._weight_group, "of", lambda group, rank: "the weight-update group")
    monkeypatch.setattr(actor_module, "send_bucket", lambda group, tensors, load_format: sent.extend(tensors))
    assert actor.broadcast_weights(new_group(), FLATTENED, "bfloat16") is None
    weights = actor.weights()  # the tied output head is sent once, as the embedding
    assert len(sent) == len(weights) and all(t.dtype == torch.bfloat16 for t in sent)
    assert all(torch.equal(t, w.bfloat16()) for t, w in zip(sent, weights.values(), strict=True))


def _stored(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_a_checkpoint_keeps_the_models_dtype_and_resumes_from_float32_master_weights(
    small_config, bf16_model_dir, tmp_path, rollout
):
    """A bf16 model's checkpoint is bf16 (half the bytes of the trainer's fp32 weights, config.json says so, the tied
    head stored once); the trainer's fp32 master weights are in the optimizer's shards, and a trainer resumed from
    the checkpoint holds them exactly and steps on exactly as the one that saved it."""
    from miles.state.checkpoint import MODEL_DIR

    RunDir(tmp_path).create()
    config = small_config(run_dir=str(tmp_path))
    saver = TrainActor(config, str(bf16_model_dir))
    assert all(p.dtype == torch.float32 for p in saver.model.parameters())
    saver.train(0, rollout)
    checkpoint = Path(saver.save_checkpoint(0, {}))

    stored = _stored(checkpoint / MODEL_DIR)
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    assert json.loads((checkpoint / MODEL_DIR / "config.json").read_text())["dtype"] == "bfloat16"
    master = saver.weights()
    assert set(stored) == set(master)
    assert all(torch.equal(stored[name], value.bfloat16()) for name, value in master.items())
    assert any(not torch.equal(value, value.bfloat16().float()) for value in master.values())  # bf16 alone loses bits

    resumed = TrainActor(config, str(bf16_model_dir), checkpoint=str(checkpoint))
    assert all(torch.equal(resumed.weights()[name], value) for name, value in master.items())
    saver.trained.clear()
    saver.train(1, rollout)
    resumed.train(1, rollout)
    assert all(torch.equal(resumed.weights()[name], value) for name, value in saver.weights().items())


def test_weight_files_are_written_in_the_dtype_the_engines_serve(small_config, bf16_model_dir, tmp_path):
    RunDir(tmp_path).create()
    actor = TrainActor(small_config(run_dir=str(tmp_path)), str(bf16_model_dir))
    own = _stored(Path(actor.write_weights(str(tmp_path / "own"))))
    assert {t.dtype for t in own.values()} == {torch.bfloat16}
    written = Path(actor.write_weights(str(tmp_path / "fp32"), "float32"))
    assert {t.dtype for t in _stored(written).values()} == {torch.float32}
    assert json.loads((written / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_the_last_step_takes_what_is_left_of_a_global_batch(
    small_config, tiny_model_dir, tmp_path, rollout, aggregation
):
    """16 samples with a global batch of 12: two steps, the second over 4 samples with its own denominators, as if
    those 4 were a rollout of their own (the engine's log-probs as the old policy make the steps independent)."""
    options = ["rollout.rollout_batch_size=3", "rollout.n_samples_per_prompt=4", "train.global_batch_size=12"]
    options += ["algo.use_rollout_logprobs=true", f"algo.loss_aggregation={aggregation}"]
    whole = _actor(small_config, tiny_model_dir, tmp_path / "a", *options)
    parts = _actor(small_config, tiny_model_dir, tmp_path / "b", *options)
    assert whole.train(0, rollout)["optimizer_steps"] == 2
    parts.train(0, rollout.slice(0, 12))
    assert parts.train(1, rollout.slice(12))["optimizer_steps"] == 1
    for name, value in whole.weights().items():
        torch.testing.assert_close(parts.weights()[name], value, atol=1e-6, rtol=1e-5)


def test_dropout_draws_the_same_numbers_whatever_came_before(small_config, tiny_model_dir, tmp_path, rollout):
    """A trainer restarted from a checkpoint has drawn nothing yet; one that never stopped has drawn a lot: each
    rollout's training draws from its own seed, so both step alike."""
    with_dropout = tmp_path / "model"
    with_dropout.mkdir()
    for file in tiny_model_dir.iterdir():
        (with_dropout / file.name).write_bytes(file.read_bytes())
    config = json.loads((with_dropout / "config.json").read_text())
    (with_dropout / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    fresh = _actor(small_config, with_dropout, tmp_path / "a")
    long_running = _actor(small_config, with_dropout, tmp_path / "b")
    torch.rand(1000)  # what the long-running one drew before
    fresh_metrics, long_metrics = fresh.train(3, rollout), long_running.train(3, rollout)
    assert fresh_metrics["loss"] == long_metrics["loss"]
    for name, value in fresh.weights().items():
        assert torch.equal(long_running.weights()[name], value)
