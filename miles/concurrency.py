"""Calls into user code (rewards, environments) that may be plain or `async`, each bounded in time, from an event
loop of their own or from worker threads."""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class CallTimedOut(Exception):
    """The outcome of a call that was not done within its time limit."""


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


def call_each_within(fn: Callable, calls: Sequence[tuple], workers: int, timeout_s: float, name: str) -> list[Any]:
    """`fn(*args)` for each `args` of `calls`, at most `workers` at once, each bounded by `timeout_s` from its start.
    Per call, in order: what it returned, the exception it raised, or CallTimedOut; a KeyboardInterrupt or SystemExit
    in a call is raised here. Coroutine functions run on an event loop of their own, plain ones in worker threads."""
    if inspect.iscoroutinefunction(fn):
        return run_in_own_loop(lambda threads: _awaited_each(threads, fn, calls, workers, timeout_s), 1, name)
    return _ThreadedCalls(fn, calls, timeout_s, name).run(workers)


async def _awaited_each(threads, fn, calls, workers, timeout_s) -> list[Any]:
    limit = asyncio.Semaphore(workers)

    async def one(args: tuple) -> Any:
        async with limit:
            try:
                return await call_within(threads, timeout_s, fn, *args)
            except TimeoutError:
                return CallTimedOut()
            except Exception as exc:
                return exc

    return await asyncio.gather(*(one(args) for args in calls))


class _ThreadedCalls:
    """Worker threads take the next call from a queue and record each outcome once (`dict.setdefault` is atomic), so a
    call costs no lock of ours, no future and no event-loop wake-up: cheap calls run back to back. The caller's thread
    sleeps until all are done or the oldest running call is past its limit; that call is recorded as timed out, its
    thread (which cannot be stopped) is abandoned, and a new worker takes its place. Daemon threads: an abandoned call
    never holds up the interpreter's exit."""

    def __init__(self, fn: Callable, calls: Sequence[tuple], timeout_s: float, name: str):
        self.fn = fn
        self.calls = calls
        self.timeout_s = timeout_s
        self.name = name
        self.waiting: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(len(calls)):
            self.waiting.put(index)
        self.outcomes: dict[int, Any] = {}
        self.current: dict[int, tuple[int, float]] = {}  # worker -> (call index, its start) of its latest call
        self.workers_started = 0
        self.abandoned: set[int] = set()
        self.interrupt: BaseException | None = None  # a KeyboardInterrupt or SystemExit in a call stops them all
        self.all_done = threading.Event()

    def run(self, workers: int) -> list[Any]:
        for _ in range(min(workers, len(self.calls))):
            self._start_worker()
        while len(self.outcomes) < len(self.calls) and self.interrupt is None:
            oldest = self._oldest_running()
            if oldest is None:
                self.all_done.wait(self.timeout_s)
                continue
            started, worker, index = oldest
            if time.monotonic() - started < self.timeout_s:
                self.all_done.wait(started + self.timeout_s - time.monotonic())
                continue
            self.abandoned.add(worker)
            self.outcomes.setdefault(index, CallTimedOut())
            if not self.waiting.empty():
                self._start_worker()
        if self.interrupt is not None:
            raise self.interrupt
        return [self.outcomes[index] for index in range(len(self.calls))]

    def _oldest_running(self) -> tuple[float, int, int] | None:
        """(start, worker, call index) of the call that has run longest, None when none runs."""
        running = [
            (started, worker, index)
            for worker, (index, started) in list(self.current.items())
            if worker not in self.abandoned and index not in self.outcomes
        ]
        return min(running, default=None)

    def _start_worker(self) -> None:  # in the caller's thread only
        worker = self.workers_started
        self.workers_started += 1
        threading.Thread(target=self._work, args=(worker,), name=f"{self.name}_{worker}", daemon=True).start()

    def _work(self, worker: int) -> None:
        while worker not in self.abandoned and self.interrupt is None:
            try:
                index = self.waiting.get_nowait()
            except queue.Empty:
                return
            self.current[worker] = (index, time.monotonic())
            try:
                outcome = self.fn(*self.calls[index])
            except Exception as exc:  # a user's code can fail on any input; only its call fails
                outcome = exc
            except BaseException as exc:  # an interrupt stops the caller, as it would in the caller's thread
                self.interrupt = exc
                self.all_done.set()
                return
            self.outcomes.setdefault(index, outcome)  # a call already recorded as timed out keeps that
            if len(self.outcomes) == len(self.calls):
                self.all_done.set()
