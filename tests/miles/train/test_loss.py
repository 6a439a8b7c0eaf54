"""miles.train.loss against hand-computed examples and direct reference computations."""

from __future__ import annotations

import math

import pytest
import torch

from miles.train.loss import k3_kl, masked_entropy, next_token_log_softmax, ppo_clip_loss, token_logprobs

EPS, EPS_HIGH = 0.2, 0.3  # clip range [0.8, 1.3]

# 2 sequences x 3 tokens. Ratios are exp(logprobs - old_logprobs).
RATIOS = [[1.1, 1.5, 0.5], [0.7, 1.4, 0.5]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
OLD = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.5]]


def _inputs(dtype=torch.float64):
    old = torch.tensor(OLD, dtype=dtype)
    logprobs = old + torch.log(torch.tensor(RATIOS, dtype=dtype))
    return logprobs, old, torch.tensor(MASK, dtype=dtype)


def test_ppo_clip_loss_per_sequence_advantages():
    logprobs, old, mask = _inputs()
    advantages = torch.tensor([1.5, -2.0], dtype=torch.float64)
    loss, clipped = ppo_clip_loss(logprobs, old, advantages, mask, EPS, EPS_HIGH)
    # Per token: max(-A r, -A clip(r, 0.8, 1.3)).
    # seq 0, A = +1.5:
    #   r=1.1 (inside):     -1.65  vs -1.65          -> -1.65, not clipped
    #   r=1.5 (above 1.3):  -2.25  vs -1.5*1.3=-1.95 -> -1.95, clipped
    #   r=0.5 (below 0.8):  -0.75  vs -1.5*0.8=-1.20 -> -0.75, not clipped (pessimistic side)
    # seq 1, A = -2.0:
    #   r=0.7 (below 0.8):   1.40  vs  2*0.8=1.60    ->  1.60, clipped
    #   r=1.4 (above 1.3):   2.80  vs  2*1.3=2.60    ->  2.80, not clipped
    #   r=0.5 masked (would be 1.0 vs 1.6, clipped)  ->  0
    expected = -1.5 * 1.1 + -1.5 * 1.3 + -1.5 * 0.5 + 2.0 * 0.8 + 2.0 * 1.4  # = 0.05
    assert loss.item() == pytest.approx(expected, abs=1e-9)
    assert clipped.item() == 2


def test_ppo_clip_loss_float32():
    logprobs, old, mask = _inputs(torch.float32)
    loss, clipped = ppo_clip_loss(logprobs, old, torch.tensor([1.5, -2.0]), mask, EPS, EPS_HIGH)
    assert loss.item() == pytest.approx(0.05, abs=1e-5)
    assert clipped.item() == 2


def test_ppo_clip_loss_gradient():
    logprobs, old, mask = _inputs()
    logprobs.requires_grad_(True)
    loss, _ = ppo_clip_loss(logprobs, old, torch.tensor([1.5, -2.0], dtype=torch.float64), mask, EPS, EPS_HIGH)
    loss.backward()
    # d(-A r)/d logp = -A r on tokens where the unclipped term wins; 0 where clipped or masked.
    expected = [[-1.5 * 1.1, 0.0, -1.5 * 0.5], [0.0, 2.0 * 1.4, 0.0]]
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected, dtype=torch.float64))


def test_ppo_clip_loss_upper_bound_uses_eps_high():
    logprobs, old, mask = _inputs()
    # With eps_high = 0.6 the upper bound is 1.6: r=1.5 and r=1.4 are inside.
    loss, clipped = ppo_clip_loss(logprobs, old, torch.tensor([1.5, -2.0], dtype=torch.float64), mask, EPS, 0.6)
    # seq 0: -1.65, -2.25, -0.75; seq 1: 1.6 (clipped below), 2.8
    assert loss.item() == pytest.approx(-1.65 - 2.25 - 0.75 + 1.6 + 2.8, abs=1e-9)
    assert clipped.item() == 1


def test_ppo_clip_loss_per_token_advantages():
    logprobs, old, mask = _inputs()
    advantages = torch.tensor([[1.5, -1.0, 0.0], [-2.0, 0.5, 4.0]], dtype=torch.float64)
    loss, clipped = ppo_clip_loss(logprobs, old, advantages, mask, EPS, EPS_HIGH)
    # seq 0: r=1.1, A=1.5:  -1.65 vs -1.65          -> -1.65
    #        r=1.5, A=-1:    1.50 vs  1.30          ->  1.50, not clipped
    #        r=0.5, A=0:     0    vs  0             ->  0, not clipped (equal terms)
    # seq 1: r=0.7, A=-2:    1.40 vs  1.60          ->  1.60, clipped
    #        r=1.4, A=0.5:  -0.70 vs -0.5*1.3=-0.65 -> -0.65, clipped
    #        masked
    expected = -1.65 + 1.5 + 0.0 + 1.6 - 0.65  # = 0.8
    assert loss.item() == pytest.approx(expected, abs=1e-9)
    assert clipped.item() == 2


def test_per_token_advantages_equal_broadcast_sequence_advantages():
    logprobs, old, mask = _inputs()
    per_seq = torch.tensor([1.5, -2.0], dtype=torch.float64)
    per_token = per_seq.unsqueeze(1).expand(2, 3).clone()
    a = ppo_clip_loss(logprobs, old, per_seq, mask, EPS, EPS_HIGH)
    b = ppo_clip_loss(logprobs, old, per_token, mask, EPS, EPS_HIGH)
    assert a[0].item() == pytest.approx(b[0].item(), abs=1e-12)
    assert a[1].item() == b[1].item()


def test_ppo_clip_loss_on_policy_is_minus_advantage_sum():
    old = torch.tensor(OLD, dtype=torch.float64)
    mask = torch.tensor(MASK, dtype=torch.float64)
    loss, clipped = ppo_clip_loss(old.clone(), old, torch.tensor([1.5, -2.0], dtype=torch.float64), mask, EPS, EPS_HIGH)
    # r = 1 everywhere: -(1.5 * 3 tokens) - (-2.0 * 2 unmasked tokens) = -4.5 + 4.0
    assert loss.item() == pytest.approx(-0.5, abs=1e-12)
    assert clipped.item() == 0


def test_k3_kl_hand_example():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -1.0, -1.4]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]], dtype=torch.float64)
    # d = ref - logp: [[-0.5, 1.0, 0.0], [0.0, 2.0 (masked), -0.4]]
    deltas = [-0.5, 1.0, 0.0, 0.0, -0.4]
    expected = sum(math.exp(d) - d - 1 for d in deltas)
    assert k3_kl(logprobs, ref, mask).item() == pytest.approx(expected, rel=1e-12)
    # exp(-0.5)+0.5-1 = 0.10653..., exp(1)-2 = 0.71828..., exp(-0.4)+0.4-1 = 0.07032...
    assert expected == pytest.approx(0.10653066 + 0.71828183 + 0.07032005, abs=1e-7)


def test_k3_kl_zero_when_equal_and_non_negative():
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 5, generator=gen)
    mask = torch.ones(3, 5)
    assert k3_kl(logprobs, logprobs.clone(), mask).item() == 0.0
    other = -torch.rand(3, 5, generator=gen)
    assert k3_kl(logprobs, other, mask).item() > 0.0


def _reference_logprobs_entropy(logits, tokens, temperature):
    """Row by row with plain Python math: log_softmax(logits[b, t-1] / T)[tokens[b, t]]."""
    B, T, V = logits.shape
    lp = [[0.0] * T for _ in range(B)]
    ent = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(1, T):
            z = [logits[b, t - 1, v].item() / temperature for v in range(V)]
            top = max(z)
            log_norm = top + math.log(sum(math.exp(x - top) for x in z))
            logp = [x - log_norm for x in z]
            lp[b][t] = logp[tokens[b, t].item()]
            ent[b][t] = -sum(math.exp(x) * x for x in logp)
    return torch.tensor(lp), torch.tensor(ent)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy(temperature):
    gen = torch.Generator().manual_seed(1)
    B, T, V = 2, 5, 7
    logits = torch.randn(B, T, V, generator=gen) * 3
    tokens = torch.randint(V, (B, T), generator=gen)
    ref_lp, ref_ent = _reference_logprobs_entropy(logits, tokens, temperature)

    lp = token_logprobs(logits, tokens, temperature)
    assert lp.shape == (B, T) and torch.all(lp[:, 0] == 0)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    assert torch.all(lp[:, 1:] < 0)
    assert torch.all(ref_ent[:, 1:] > 0) and torch.all(ref_ent <= math.log(V) + 1e-5)

    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 1, 1, 1]])
    entropy = masked_entropy(next_token_log_softmax(logits, temperature), mask)
    torch.testing.assert_close(entropy, (ref_ent * mask).sum(), rtol=1e-5, atol=1e-5)


def test_token_logprobs_upcasts_half_precision():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 4, 6, generator=gen).to(torch.bfloat16)
    tokens = torch.randint(6, (1, 4), generator=gen)
    lp = token_logprobs(logits, tokens)
    assert lp.dtype == torch.float32
    ref_lp, _ = _reference_logprobs_entropy(logits.float(), tokens, 1.0)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
