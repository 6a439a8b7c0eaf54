"""Data-parallel training: two FSDP-sharded ranks (gloo, two processes) make the update one process makes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoTokenizer

from miles.engines.torch_engine import TorchEngine
from miles.rollout.store import RolloutStore
from miles.train.algorithms.advantages import grpo
from miles.train.update import rank_rows
from tests.helpers.data_parallel import train_one_rank
from tests.helpers.samples import make_requests, seeded, training_table


def test_rank_rows_deal_equal_counts_balanced_by_tokens():
    tokens = torch.tensor([5, 1, 9, 3, 7, 2, 8, 4])
    # Longest first: 9 (row 2), 8 (6), 7 (4), 5 (0), 4 (7), 3 (3), 2 (5), 1 (1), dealt 0, 1, 1, 0, 0, 1, 1, 0.
    first, second = rank_rows(tokens, 2)
    assert first.tolist() == [0, 1, 2, 7] and second.tolist() == [3, 4, 5, 6]
    assert (int(tokens[first].sum()), int(tokens[second].sum())) == (9 + 5 + 4 + 1, 8 + 7 + 3 + 2)


@pytest.fixture(scope="module")
def rollout_file(tiny_model_dir, tmp_path_factory):
    """48 samples of the tiny model with random group-normalised advantages: three global batches of 16."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    requests = make_requests(tokenizer, [f"{a}+{2 * a + 1}=" for a in range(12)] * 4, max_new_tokens=6)
    results = TorchEngine(str(tiny_model_dir), num_threads=1).generate(seeded(requests, 5))
    rewards = torch.rand(len(results), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    table = training_table(requests, results, grpo(rewards, torch.arange(len(results)) // 4).tolist())
    store = RolloutStore(tmp_path_factory.mktemp("rollouts"))
    store.write(0, table)
    return str(store.path(0))


@pytest.mark.parametrize(
    "algorithm", [[], ["algo.policy_loss=gspo", "algo.tis_level=sequence"]], ids=["ppo_clip", "gspo"]
)
def test_two_sharded_ranks_equal_one_process(tiny_model_dir, rollout_file, tmp_path, algorithm):
    overrides = [
        "rollout.rollout_batch_size=12",
        "rollout.n_samples_per_prompt=4",
        "train.global_batch_size=16",
        "train.micro_batch_size=4",
        "train.lr=1e-3",
        *algorithm,
    ]
    one, two = str(tmp_path / "one.safetensors"), str(tmp_path / "two.safetensors")
    train_one_rank(0, 1, "", str(tiny_model_dir), rollout_file, overrides, one)
    rendezvous = str(tmp_path / "rendezvous")
    mp.spawn(train_one_rank, args=(2, rendezvous, str(tiny_model_dir), rollout_file, overrides, two), nprocs=2)

    single, sharded = load_file(one), load_file(two)
    assert single.keys() == sharded.keys()
    moved = max(
        float((single[k] - v).abs().max())
        for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items()
        if k in single
    )
    assert moved > 1e-4  # three Adam steps moved the weights
    gap = max(float((single[k] - sharded[k]).abs().max()) for k in single)
    print(f"moved {moved:.2e}, two ranks vs one {gap:.2e}")
    assert gap < 1e-5
    m_single, m_sharded = (json.loads(open(path + ".json").read()) for path in (one, two))
    assert m_single["optimizer_steps"] == m_sharded["optimizer_steps"] == 3
    for key in ("loss", "pg_loss", "entropy", "clip_fraction", "grad_norm", "train_rollout_logprob_abs_diff"):
        assert m_sharded[key] == pytest.approx(m_single[key], rel=1e-4, abs=1e-6), key
