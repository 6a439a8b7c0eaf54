"""The embedded default model: a tiny Llama and a character tokenizer, in Hugging Face format."""

from miles.models.tiny import build_tiny_model, build_tokenizer, ensure_embedded_model

__all__ = ["build_tokenizer", "build_tiny_model", "ensure_embedded_model"]
