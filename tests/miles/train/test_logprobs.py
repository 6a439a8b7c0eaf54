"""miles.train.logprobs against row-by-row computations in plain Python."""

from __future__ import annotations

import math

import pytest
import torch

from miles.train.logprobs import next_token_log_softmax, token_entropy, token_logprobs


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
    entropy = token_entropy(next_token_log_softmax(logits, temperature), mask)
    torch.testing.assert_close(entropy, ref_ent * mask, rtol=1e-5, atol=1e-5)


def test_token_logprobs_upcasts_half_precision():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 4, 6, generator=gen).to(torch.bfloat16)
    tokens = torch.randint(6, (1, 4), generator=gen)
    lp = token_logprobs(logits, tokens)
    assert lp.dtype == torch.float32
    ref_lp, _ = _reference_logprobs_entropy(logits.float(), tokens, 1.0)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
