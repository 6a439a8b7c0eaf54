"""Calls into user code (rewards, environments) that may be plain or `async`, each bounded in time, from an event
loop of their own."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def run_in_own_loop(main: Callable[[ThreadPoolExecutor], Coroutine[Any, Any, T]], workers: int, name: str) -> T:
    """`main(threads)` on an event loop run in a thread of its own (so it works whether or not the caller's thread
    runs one), with `workers` threads for plain functions. A plain function that outlasts its time limit cannot be
    stopped: its thread is left behind, not waited for."""
    threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    try:
        with ThreadPoolExecutor(max_workers=1) as runner:
            return runner.submit(asyncio.run, main(threads)).result()
    finally:
        threads.shutdown(wait=False, cancel_futures=True)


async def call_within(threads: ThreadPoolExecutor, timeout_s: float, fn: Callable, *args: Any) -> Any:
    """`fn(*args)`: awaited when `fn` is a coroutine function, else run in `threads`; TimeoutError past `timeout_s`."""
    if inspect.iscoroutinefunction(fn):
        call = fn(*args)
    else:
        call = asyncio.get_running_loop().run_in_executor(threads, fn, *args)
    return await asyncio.wait_for(call, timeout_s)
