"""The memory budget per GPU (miles.cluster.memory_budget), on hand-computed values."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from miles.cluster.memory_budget import GIB, ModelShape, budget, colocated_engine_share, resident_bytes, trainer_parts
from miles.config import load_config

SHAPE = ModelShape(parameters=10**9, layers=10, hidden=1000, dtype="bfloat16")
GPU_RUN = [
    "model.path=/models/any",
    "data.task=null",
    "data.path=prompts.jsonl",
    "rollout.engine=sglang",
    "rollout.device=cuda",
    "train.device=cuda",
]


@pytest.mark.parametrize("tied", [True, False])
def test_the_shape_counts_the_parameters_a_model_has_from_its_config_alone(tmp_path, tied):
    config = LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        tie_word_embeddings=tied, dtype="bfloat16",
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    built = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert ModelShape.read(tmp_path) == ModelShape(built, 3, 64, "bfloat16")
    assert (
        built
        == ModelShape.read(tmp_path).parameters
        == (3 * 64 * 128 * 3 + 3 * 4 * 64 * 64 + 7 * 64 + 500 * 64 * (1 if tied else 2))
    )


def test_a_sharded_bf16_trainer_rank_holds_its_share_of_every_state_and_one_micro_batch():
    config = load_config(
        None,
        [*GPU_RUN, "train.num_workers=4", "train.param_dtype=bfloat16", "train.gradient_checkpointing=true",
         "train.max_tokens_per_micro_batch=1000", "train.logits_chunk_mb=64", "algo.use_kl_loss=true",
         "train.global_batch_size=64", "train.micro_batch_size=16"],
    )  # fmt: skip
    parts = trainer_parts(config, SHAPE)
    assert parts == {
        "master weights": 1e9,  # 4 bytes x 1e9 / 4 ranks
        "gradients": 1e9,
        "Adam moments": 2e9,
        "reference": 1e9,  # the KL loss's starting policy
        "gathered layers": 4e8,  # two bf16 layers of 1e8 parameters
        # each of 10 layers keeps its bf16 input (1000 x 1000 x 2), one layer recomputed whole (34 x 1000 x 1000),
        # two float32 logit chunks of 64 MiB
        "activations": 10 * 1000 * 1000 * 2 + 34 * 1000 * 1000 + 2 * 64 * 2**20,
    }


def test_a_colocated_gpu_holds_the_trainer_step_or_the_engine_beside_its_resident_states_and_is_refused_past_it():
    overrides = [*GPU_RUN, "rollout.colocate=true", "train.max_tokens_per_micro_batch=1000"]
    config = load_config(None, [*overrides, "rollout.sglang.mem_fraction_static=0.3"])
    stepping, generating = budget(config, SHAPE, "bfloat16", gpu_gib=80)
    assert stepping.parts == trainer_parts(config, SHAPE)  # the engine released its weights and KV cache
    assert stepping.parts["master weights"] == 4e9  # one unsharded rank
    assert "activations" not in generating.parts and generating.parts["Adam moments"] == 8e9
    assert generating.parts["engine weights"] == 2e9
    assert generating.parts["engine weights"] + generating.parts["KV cache"] == 0.3 * 80 * GIB
    with pytest.raises(
        ValueError, match=r"engine generating beside its trainer rank: .* of 20 GiB .* does not fit in 90% of the GPU"
    ):
        budget(config, SHAPE, "bfloat16", gpu_gib=20)
    tight = load_config(None, [*overrides, "rollout.sglang.mem_fraction_static=0.02"])
    with pytest.raises(
        ValueError, match=r"mem_fraction_static=0.02 of a 80 GiB GPU does not hold the engine's weights"
    ):
        budget(tight, SHAPE, "bfloat16", gpu_gib=80)


def test_a_colocated_engine_is_given_what_its_trainer_rank_leaves_of_the_usable_memory():
    config = load_config(None, [*GPU_RUN, "rollout.colocate=true", "train.max_tokens_per_micro_batch=1000"])
    resident = resident_bytes(trainer_parts(config, SHAPE))
    assert resident == 16e9  # master weights 4e9, gradients 4e9, Adam moments 8e9: no activations between steps
    assert colocated_engine_share(resident, 80 * GIB) == 0.713  # 0.9 - 0.186, rounded down
    _, generating = budget(config, SHAPE, "bfloat16", gpu_gib=80)
    assert generating.parts["engine weights"] + generating.parts["KV cache"] == pytest.approx(0.713 * 80 * GIB)
    with pytest.raises(ValueError, match=r"keeps 16.0 GiB of its 16 GiB GPU between steps: no room"):
        colocated_engine_share(16 * GIB, 16 * GIB)


def test_apart_the_trainer_and_the_engine_are_budgeted_on_gpus_of_their_own():
    config = load_config(None, [*GPU_RUN, "train.max_tokens_per_micro_batch=1000"])
    trainer, engine = budget(config, SHAPE, "bfloat16", gpu_gib=80)
    assert trainer.name == "trainer rank" and "engine weights" not in trainer.parts
    assert engine.parts == {"engine weights": 2e9}  # bf16; the KV cache is SGLang's to size on its own GPU
