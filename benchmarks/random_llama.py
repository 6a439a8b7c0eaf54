"""The benchmarks' model: a randomly initialised Llama in Hugging Face format, seeded, of a chosen shape."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from miles.models.tiny import build_tokenizer


def random_llama(
    directory: Path, hidden: int, layers: int, vocab: int, positions: int, heads: int | None = None
) -> LlamaForCausalLM:
    """Build the model, save it to `directory` with the embedded tokenizer (a trainer loads one beside the weights),
    and return it. `heads` defaults to one per 64 hidden units."""
    heads = heads or max(1, hidden // 64)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=hidden * 8 // 3,
        max_position_embeddings=positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return model
