"""miles.train.logprobs against row-by-row computations in plain Python."""

from __future__ import annotations

import math

import pytest
import torch

from miles.train.logprobs import chunk_positions, token_logprobs, token_stats
from tests.helpers import small_llama


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


def test_chunk_positions_bound_the_chunks_logits():
    assert chunk_positions(vocab_size=49152, chunk_mb=64) == 341  # 64 MiB / (49152 x 4 bytes)
    assert chunk_positions(vocab_size=16, chunk_mb=64) == 2**20
    assert chunk_positions(vocab_size=10**9, chunk_mb=1) == 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_stats_in_chunks_equal_the_full_logits(temperature):
    """Log-probs, entropies and both gradients are those of the full-vocabulary logits, whatever the chunk size
    (here 3 positions of a 50-token vocabulary: 600 bytes per chunk, 6 chunks), with the padding's positions."""
    model = small_llama()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(50, (2, 9), generator=gen)
    attention = torch.ones_like(tokens)
    attention[1, 6:] = 0

    logits = model(input_ids=tokens, attention_mask=attention).logits
    ref_lp, ref_ent = _reference_logprobs_entropy(logits.detach(), tokens, temperature)
    full_lp = token_logprobs(logits, tokens, temperature)
    full_lp.sum().backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    lp, entropy = token_stats(model, tokens, attention, temperature, chunk_mb=3 * 50 * 4 / 2**20)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_ent, rtol=1e-5, atol=1e-5)
    assert not entropy.requires_grad  # a metric: no graph kept for it
    lp.sum().backward()
    for got, want in zip((p.grad for p in model.parameters()), full_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_entropy_carries_a_gradient_when_the_loss_has_it():
    model = small_llama()
    tokens = torch.randint(50, (1, 6), generator=torch.Generator().manual_seed(4))
    logits = model(input_ids=tokens).logits[:, :-1]
    log_softmax = torch.log_softmax(logits, dim=-1)
    (-(log_softmax.exp() * log_softmax).sum()).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _, entropy = token_stats(model, tokens, torch.ones_like(tokens), 1.0, chunk_mb=1e-4, entropy_grad=True)
    entropy.sum().backward()
    for got, expected in zip((p.grad for p in model.parameters()), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_the_head_is_its_own_again_after_token_stats_even_when_the_forward_fails():
    model = small_llama()
    head = model.get_output_embeddings()
    with pytest.raises(IndexError):
        token_stats(model, torch.tensor([[1, 2, 99]]), torch.ones(1, 3, dtype=torch.long), 1.0, chunk_mb=1)
    assert "forward" not in vars(head)
    assert model(input_ids=torch.tensor([[1, 2]])).logits.shape == (1, 2, 50)


def test_a_model_that_caps_its_logits_after_the_head_is_refused():
    model = small_llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        token_stats(model, torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.long), 1.0, chunk_mb=1)


def test_token_logprobs_upcasts_half_precision():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 4, 6, generator=gen).to(torch.bfloat16)
    tokens = torch.randint(6, (1, 4), generator=gen)
    lp = token_logprobs(logits, tokens)
    assert lp.dtype == torch.float32
    ref_lp, _ = _reference_logprobs_entropy(logits.float(), tokens, 1.0)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
