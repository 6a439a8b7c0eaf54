"""miles.train.algorithms.advantages: the built-in advantage estimators on hand values and their invariants."""

from __future__ import annotations

import math

import pytest
import torch

from miles.train.algorithms.advantages import (
    EPS,
    dr_grpo,
    gpg,
    grpo,
    opo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    reinforce_plus_plus_sample,
    remax,
    rloo,
)

# Three prompt groups with arbitrary ids, interleaved: group 7 has rewards 1, 0, 0; group -3 has 2, 4; group 1000 has
# a single sample (its siblings failed) with reward 5.
SCORES = torch.tensor([1.0, 2.0, 0.0, 5.0, 4.0, 0.0], dtype=torch.float64)
GROUPS = torch.tensor([7, -3, 7, 1000, -3, 7], dtype=torch.int64)
# One trained token each: token-level and sample-level statistics agree.
LENGTHS = torch.ones(6, dtype=torch.float64)

GROUP_BASELINE = [grpo, dr_grpo, rloo, reinforce_plus_plus_baseline, gpg, opo]
ALL = [*GROUP_BASELINE, reinforce_plus_plus, reinforce_plus_plus_sample]


def _expect(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_grpo_hand_values():
    # group 7: rewards 1,0,0, mean 1/3, centred 2/3,-1/3,-1/3, squares sum 4/9+1/9+1/9 = 2/3,
    #   unbiased var (2/3)/2 = 1/3, std sqrt(1/3)
    # group -3: rewards 2,4, mean 3, centred -1,1, unbiased var 2/1 = 2, std sqrt(2)
    # group 1000: one sample, std 0, centred 0 -> 0
    s7 = math.sqrt(1 / 3) + EPS
    s3 = math.sqrt(2) + EPS
    expected = _expect([(2 / 3) / s7, -1 / s3, (-1 / 3) / s7, 0.0, 1 / s3, (-1 / 3) / s7])
    torch.testing.assert_close(grpo(SCORES, GROUPS, LENGTHS), expected)


def test_grpo_eps_is_added_outside_the_square_root():
    # rewards 0,2: mean 1, centred -1,1, unbiased var 2, std sqrt(2); eps on the std, not on the variance
    out = grpo(_expect([0.0, 2.0]), torch.tensor([0, 0]), _expect([1.0, 1.0]))
    torch.testing.assert_close(out, _expect([-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)]))


def test_grpo_equal_scores_give_zero_not_nan():
    out = grpo(_expect([0.5, 0.5, 0.5]), torch.tensor([1, 1, 1]), _expect([1.0] * 3))
    torch.testing.assert_close(out, _expect([0.0, 0.0, 0.0]))


def test_dr_grpo_hand_values():
    # r - group mean: group 7 mean 1/3 -> 2/3,-1/3,-1/3; group -3 mean 3 -> -1,1; group 1000: 5 - 5 = 0
    torch.testing.assert_close(dr_grpo(SCORES, GROUPS, LENGTHS), _expect([2 / 3, -1.0, -1 / 3, 0.0, 1.0, -1 / 3]))


def test_rloo_hand_values():
    # r_i - mean of the other samples: group 7: 1 - (0+0)/2 = 1, 0 - (1+0)/2 = -1/2 (twice);
    # group -3: 2 - 4 = -2, 4 - 2 = 2; group 1000 has no other sample -> 0
    torch.testing.assert_close(rloo(SCORES, GROUPS, LENGTHS), _expect([1.0, -2.0, -0.5, 0.0, 2.0, -0.5]))


def test_reinforce_plus_plus_hand_values():
    # whole batch 1,2,0,5,4,0: mean 12/6 = 2, centred -1,0,-2,3,2,-2, squares 1+0+4+9+4+4 = 22,
    # unbiased var 22/5, std sqrt(4.4); groups play no part
    std = math.sqrt(22 / 5) + EPS
    expected = _expect([-1 / std, 0.0, -2 / std, 3 / std, 2 / std, -2 / std])
    torch.testing.assert_close(reinforce_plus_plus(SCORES, GROUPS, LENGTHS), expected)


def test_reinforce_plus_plus_ignores_groups():
    other_groups = torch.tensor([0, 1, 2, 3, 4, 5])
    torch.testing.assert_close(
        reinforce_plus_plus(SCORES, other_groups, LENGTHS), reinforce_plus_plus(SCORES, GROUPS, LENGTHS)
    )


def test_reinforce_plus_plus_baseline_hand_values():
    # group baseline first: 2/3,-1,-1/3,0,1,-1/3 (dr_grpo's values); their batch mean is 0;
    # squares 4/9+1+1/9+0+1+1/9 = 8/3, unbiased var (8/3)/5 = 8/15, std sqrt(8/15)
    std = math.sqrt(8 / 15) + EPS
    expected = _expect([(2 / 3) / std, -1 / std, (-1 / 3) / std, 0.0, 1 / std, (-1 / 3) / std])
    torch.testing.assert_close(reinforce_plus_plus_baseline(SCORES, GROUPS, LENGTHS), expected)


def test_reinforce_plus_plus_baseline_equal_group_gets_zero():
    # group 0 all 0.3 -> 0 after the baseline; group 1: 0,1 -> -1/2,1/2
    scores = _expect([0.3, 0.3, 0.3, 0.0, 1.0])
    out = reinforce_plus_plus_baseline(scores, torch.tensor([0, 0, 0, 1, 1]), torch.ones_like(scores))
    torch.testing.assert_close(out[:3], _expect([0.0, 0.0, 0.0]), atol=1e-9, rtol=0)
    assert out[3] < 0 < out[4]


@pytest.mark.parametrize(
    "fn", [reinforce_plus_plus, reinforce_plus_plus_sample, reinforce_plus_plus_baseline], ids=lambda f: f.__name__
)
def test_batch_of_one_gets_zero(fn):
    out = fn(_expect([3.0]), torch.tensor([0]), _expect([5.0]))
    torch.testing.assert_close(out, _expect([0.0]))


def _random_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # groups of sizes 1..5 with scattered ids, shuffled so that each group's samples are interleaved
    groups = torch.cat([torch.full((size,), gid) for gid, size in [(11, 4), (2, 1), (-5, 3), (40, 5), (9, 2)]])
    groups = groups[torch.randperm(len(groups), generator=gen)]
    scores = torch.rand(len(groups), generator=gen, dtype=torch.float64) * 4 - 1
    return scores, groups


@pytest.mark.parametrize("fn", GROUP_BASELINE[:3], ids=lambda f: f.__name__)
def test_zero_mean_per_group(fn):
    scores, groups = _random_batch()
    out = fn(scores, groups, torch.ones_like(scores))
    for gid in groups.unique():
        members = out[groups == gid]
        assert members.sum().item() == pytest.approx(0.0, abs=1e-9), int(gid)
    assert out.abs().sum() > 0


@pytest.mark.parametrize(
    "fn", [reinforce_plus_plus, reinforce_plus_plus_sample, reinforce_plus_plus_baseline], ids=lambda f: f.__name__
)
def test_zero_mean_over_batch(fn):
    scores, groups = _random_batch()
    out = fn(scores, groups, torch.ones_like(scores))
    assert out.sum().item() == pytest.approx(0.0, abs=1e-9)
    # global normalisation: unit unbiased std up to eps
    assert out.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-5)


def test_reinforce_plus_plus_baseline_zero_mean_per_group():
    # the baseline centres each group; the batch normalisation only rescales (the batch mean is already 0)
    scores, groups = _random_batch()
    out = reinforce_plus_plus_baseline(scores, groups, torch.ones_like(scores))
    for gid in groups.unique():
        assert out[groups == gid].sum().item() == pytest.approx(0.0, abs=1e-9), int(gid)


@pytest.mark.parametrize("fn", GROUP_BASELINE, ids=lambda f: f.__name__)
def test_group_of_one_gets_zero(fn):
    scores, groups = _random_batch()
    out = fn(scores, groups, torch.ones_like(scores))
    single = groups == 2
    assert single.sum() == 1
    assert out[single].item() == 0.0
    assert out[~single].abs().sum() > 0


def _lengths(scores: torch.Tensor) -> torch.Tensor:
    return (torch.arange(len(scores)) % 4 + 1).to(torch.float64)


@pytest.mark.parametrize("fn", ALL, ids=lambda f: f.__name__)
def test_permutation_invariant(fn):
    scores, groups = _random_batch()
    lengths = _lengths(scores)
    perm = torch.randperm(len(scores), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(fn(scores[perm], groups[perm], lengths[perm]), fn(scores, groups, lengths)[perm])


@pytest.mark.parametrize("fn", ALL, ids=lambda f: f.__name__)
def test_relabelling_groups_changes_nothing(fn):
    scores, groups = _random_batch()
    lengths = _lengths(scores)
    torch.testing.assert_close(fn(scores, groups * 7 + 100, lengths), fn(scores, groups, lengths))


def test_rloo_is_k_over_k_minus_1_times_dr_grpo():
    scores, groups = _random_batch()
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    k = counts[inverse].to(torch.float64)
    multi = k > 1
    expected = dr_grpo(scores, groups, torch.ones_like(scores))[multi] * k[multi] / (k[multi] - 1)
    torch.testing.assert_close(rloo(scores, groups, torch.ones_like(scores))[multi], expected)
    # group sizes 4, 3, 5, 2 all appear
    assert set(k[multi].tolist()) == {2.0, 3.0, 4.0, 5.0}


@pytest.mark.parametrize("fn", ALL, ids=lambda f: f.__name__)
def test_shape_and_dtype(fn):
    out = fn(SCORES, GROUPS, LENGTHS)
    assert out.shape == SCORES.shape
    assert out.dtype == torch.float64
    assert torch.isfinite(out).all()


def test_gpg_hand_values():
    # dr_grpo's centred scores [2/3, -1, -1/3, 0, 1, -1/3]; 5 of the 6 are not 0 (the single sample's is): x 6/5
    torch.testing.assert_close(gpg(SCORES, GROUPS, LENGTHS), _expect([0.8, -1.2, -0.4, 0.0, 1.2, -0.4]))


def test_gpg_all_equal_groups_give_zero_not_nan():
    torch.testing.assert_close(
        gpg(_expect([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]), _expect([1.0] * 4)), _expect([0.0] * 4)
    )


def test_reinforce_plus_plus_whitens_over_tokens_as_its_paper():
    # scores 1, 0 over 3 and 1 tokens: token mean 3/4, unbiased token variance (3 (1/4)^2 + (3/4)^2) / 3 = 1/4
    out = reinforce_plus_plus(_expect([1.0, 0.0]), torch.tensor([0, 1]), _expect([3.0, 1.0]))
    torch.testing.assert_close(out, _expect([0.25 / (0.5 + EPS), -0.75 / (0.5 + EPS)]))
    # per sample, the lengths do not count: mean 1/2, std sqrt(1/2)
    sample = reinforce_plus_plus_sample(_expect([1.0, 0.0]), torch.tensor([0, 1]), _expect([3.0, 1.0]))
    torch.testing.assert_close(sample, _expect([0.5, -0.5]) / (0.5**0.5 + EPS))


def test_opo_baseline_is_the_length_weighted_group_mean():
    # group 0: scores 1, 0, 1 over 2, 4, 2 tokens: baseline (2 + 0 + 2) / 8 = 0.5 (the plain mean would be 2/3)
    out = opo(_expect([1.0, 0.0, 1.0, 3.0]), torch.tensor([0, 0, 0, 1]), _expect([2.0, 4.0, 2.0, 7.0]))
    torch.testing.assert_close(out, _expect([0.5, -0.5, 0.5, 0.0]))


def test_remax_subtracts_the_greedy_responses_reward_and_gives_0_without_one():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    baselines = torch.tensor([0.5, 0.5, float("nan"), 0.25], dtype=torch.float64)
    torch.testing.assert_close(remax(scores, baselines), torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64))
