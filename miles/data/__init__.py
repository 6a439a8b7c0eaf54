"""Prompt datasets and the DataSource that walks them with a saved cursor."""

from miles.data.datasets import load_rows
from miles.data.source import DataSource

__all__ = ["DataSource", "load_rows"]
