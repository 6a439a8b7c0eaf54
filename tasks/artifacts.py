"""Helpers of Prefect artifacts: table rows from metrics.jsonl records, keys from names."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any


def table_rows(records: list[dict[str, Any]], shown: Callable[[str], bool]) -> list[dict[str, Any]]:
    """The records' shown fields, floats to 4 decimals (a table to read, not the data: that is metrics.jsonl)."""
    return [{key: round(v, 4) if isinstance(v, float) else v for key, v in r.items() if shown(key)} for r in records]


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes) from `parts` (a run's name, what it holds); each
    new artifact of one key is a new version of it in the UI."""
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")
