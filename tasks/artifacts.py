"""Rows of a Prefect table artifact from metrics.jsonl records."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def table_rows(records: list[dict[str, Any]], shown: Callable[[str], bool]) -> list[dict[str, Any]]:
    """The records' shown fields, floats to 4 decimals (a table to read, not the data: that is metrics.jsonl)."""
    return [{key: round(v, 4) if isinstance(v, float) else v for key, v in r.items() if shown(key)} for r in records]
