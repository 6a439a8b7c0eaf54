"""Waiting for a state another thread or process reaches: poll what is observed, up to a deadline that only a hang
meets (how long the wait took is never what a test checks)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(condition: Callable[[], T], timeout_s: float = 60.0, every_s: float = 0.01) -> T:
    """The first truthy value of `condition()`, polled every `every_s`; its last value once `timeout_s` is past."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(every_s)
    return value
