"""The benchmarks' model: a randomly initialised Llama in Hugging Face format, seeded, of a chosen shape."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from miles.models.tiny import build_tokenizer


def random_llama(
    directory: Path,
    hidden: int,
    layers: int,
    vocab: int,
    positions: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    tie_embeddings: bool = False,
) -> LlamaForCausalLM:
    """Build the model, save it to `directory` with the embedded tokenizer (a trainer loads one beside the weights),
    and return it. `heads` defaults to one per 64 hidden units, `kv_heads` to `heads` (no grouped-query attention),
    `intermediate` to 8/3 of `hidden`; `tie_embeddings` shares the input embedding with the output head."""
    heads = heads or max(1, hidden // 64)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        intermediate_size=intermediate or hidden * 8 // 3,
        max_position_embeddings=positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=tie_embeddings,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return model
