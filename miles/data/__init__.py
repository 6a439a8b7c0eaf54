"""Prompt datasets and the DataSource that walks them with a saved cursor."""

from miles.data.datasets import check_prompt_tokens, load_rows
from miles.data.source import DataSource

__all__ = ["DataSource", "check_prompt_tokens", "load_rows"]
