"""Per-token log-probs and entropies of a causal LM over [B, T] token grids, without the full-vocabulary logits.

A model's output head is run a chunk of positions at a time (`token_stats`): the [B, T, V] fp32 logits of a
micro-batch (and their log-softmax, and their gradient) would grow with micro-batch x length x vocabulary, 7 GB on a
49k-vocabulary model with 16 samples of 200 tokens. Each chunk is recomputed in the backward (activation
checkpointing), so the forward keeps only the chunk's hidden states, the head's input."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

FP32_BYTES = 4


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of tokens[:, t] given the prefix, at position t ([B, T]; position 0 has none and is 0), from logits
    that are at hand already ([B, T, V]: a short sequence)."""
    log_softmax = _next_token_log_softmax(logits, temperature)
    picked = log_softmax.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def _next_token_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-softmax in float32 of the distribution that produced each next token; the division is skipped at
    temperature 1 (it would copy the whole logits tensor, and its gradient, for nothing)."""
    scaled = logits[:, :-1].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    return torch.log_softmax(scaled, dim=-1)


def chunk_positions(vocab_size: int, chunk_mb: float) -> int:
    """Positions per chunk so that a chunk's fp32 logits take at most `chunk_mb` MiB (at least one position)."""
    return max(1, int(chunk_mb * 2**20) // (vocab_size * FP32_BYTES))


def token_stats(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    chunk_mb: float,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob, entropy) of the distribution that produced each token, at the token's position ([B, T] each;
    position 0 has none and holds 0), in float32.

    The model's output head (`get_output_embeddings`, with whatever it holds: a LoRA layer, a bias) runs inside the
    model's own forward, as always, so a sharded model's hooks gather and free its weight as they would; it is only
    handed a chunk of positions at a time. The entropy carries a gradient only with `entropy_grad` (an entropy
    bonus in the loss); otherwise it is a metric."""
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        raise ValueError(
            f"{type(model).__name__} caps its logits after the output head (final_logit_softcapping): per-token "
            "log-probs computed in chunks at the head would miss the cap"
        )
    head = model.get_output_embeddings()
    positions = chunk_positions(head.out_features, chunk_mb)
    targets = tokens[:, 1:]
    head.forward = partial(_chunked_head, head.forward, targets, temperature, positions, entropy_grad)
    try:
        stats = model(input_ids=tokens, attention_mask=attention_mask).logits
    finally:
        del head.forward  # the class's own forward again
    padded = torch.nn.functional.pad(stats, (0, 0, 1, 0))
    entropy = padded[..., 1]
    return padded[..., 0], entropy if entropy_grad else entropy.detach()


def _chunked_head(
    project: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    temperature: float,
    positions: int,
    entropy_grad: bool,
    hidden: torch.Tensor,
) -> torch.Tensor:
    """The head's forward while `token_stats` runs: from hidden states [B, T, H] to [B, T-1, 2] (log-prob, entropy)
    of each next token, `positions` at a time. The model returns this in place of its logits."""
    batch, width, size = hidden.shape
    flat_hidden = hidden[:, : width - 1].reshape(-1, size)
    flat_targets = targets.reshape(-1)
    recompute = torch.is_grad_enabled() and flat_hidden.shape[0] > positions
    chunks = []
    for start in range(0, flat_hidden.shape[0], positions):
        args = (project, flat_hidden[start : start + positions], flat_targets[start : start + positions])
        if recompute:
            chunks.append(checkpoint(_chunk_stats, *args, temperature, entropy_grad, use_reentrant=False))
        else:
            chunks.append(_chunk_stats(*args, temperature, entropy_grad))
    # a tensor of its own, not a view: FSDP2 warns that an in-place op on a module's output view skips its hooks
    return torch.cat(chunks).reshape(batch, width - 1, 2).clone()


def _chunk_stats(
    project: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy_grad: bool,
) -> torch.Tensor:
    logits = project(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    logprob = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)
    return torch.stack([logprob, entropy], dim=-1)
