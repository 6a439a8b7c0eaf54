"""Answer checkers for math data: `math` (math-verify) and `gsm8k` (the `#### <number>` convention).

Both score 1.0 for a right final answer and 0.0 otherwise, and 0.0 for a response cut at max_new_tokens
(`finished` False): it never finished its answer.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import threading
from decimal import Decimal, InvalidOperation

from math_verify import parse, verify
from pebble import ProcessPool

# Seconds a math verification may run in its worker process before the worker is killed and the call raises.
MATH_VERIFY_TIMEOUT_S = 10
# math-verify's own limits (SIGALRM, whole seconds), on in the workers but above the pool's bound: they never cut
# short a call the pool watches, but stop the work of a worker whose parent died mid-call, so it then exits.
_WORKER_OWN_LIMIT_S = 2 * MATH_VERIFY_TIMEOUT_S

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")

_pool: ProcessPool | None = None
_pool_lock = threading.Lock()


def math_answer(response: str, label: str, finished: bool) -> float:
    """1.0 when the response's final answer equals the label mathematically (math-verify, Hugging Face).

    The answer is the response's last `\\boxed{...}`, else its last LaTeX or plain expression; the label is
    parsed as a LaTeX expression (`$...$` is added when it has no delimiters). Equivalent forms score alike:
    `1/2`, `0.5`, `\\frac{1}{2}`, `\\dfrac12`; `2\\sqrt{2}` and `\\sqrt{8}`; `x^2+2x+1` and `(x+1)^2`; sets in any
    order; `1,000` and `1000`. Numbers are compared after rounding to 6 decimals (math-verify's default).

    Each check runs in a worker process of a small pool (sympy can run for minutes or more on some inputs, e.g. a
    power tower, and a thread cannot be stopped): one that takes longer than MATH_VERIFY_TIMEOUT_S (10 s) from
    when a worker takes it up raises TimeoutError, and its worker is killed and replaced. The scorer's
    data.reward_timeout_s (default 30 s) still bounds the whole call, waiting for a free worker included; keep it
    above MATH_VERIFY_TIMEOUT_S so that a slow check is stopped here and reported as such."""
    if not finished:
        return 0.0
    checking = _verification_pool().schedule(_check, (response, label), timeout=MATH_VERIFY_TIMEOUT_S)
    try:
        return checking.result()
    except TimeoutError:
        raise TimeoutError(
            f"math-verify took over {MATH_VERIFY_TIMEOUT_S:g} s (MATH_VERIFY_TIMEOUT_S); its worker process was killed"
        ) from None


def _check(response: str, label: str) -> float:
    """math_answer's check, in a worker process's main thread (where math-verify's SIGALRM limits work)."""
    gold = parse(label if "$" in label or "\\boxed" in label else f"${label}$", parsing_timeout=_WORKER_OWN_LIMIT_S)
    if not gold:
        raise ValueError(f"the label {label!r} is not an expression math-verify can parse")
    answer = parse(response, parsing_timeout=_WORKER_OWN_LIMIT_S)
    return 1.0 if answer and verify(gold, answer, timeout_seconds=_WORKER_OWN_LIMIT_S) else 0.0


def _verification_pool() -> ProcessPool:
    """This process's pool for math_answer, made at first use, and made anew should pebble have stopped it (as it
    does when an idle worker dies). Its workers are forked: spawned ones would first re-run the caller's main
    script, and a plain script that calls `miles.loop.run_sync` has no `if __name__ == "__main__"` guard. Pebble
    kills the workers when this process exits."""
    global _pool
    with _pool_lock:
        if _pool is None or not _pool.active:
            if _pool is not None:
                _pool.stop()
                _pool.join()
            _pool = ProcessPool(max_workers=min(4, os.cpu_count() or 1), context=multiprocessing.get_context("fork"))
        return _pool


def gsm8k_answer(response: str, label: str, finished: bool) -> float:
    """1.0 when the response's final number equals the label's (GSM8K, Cobbe et al. 2021, arXiv:2110.14168).

    The label is GSM8K's answer field (a worked solution ending `#### 72`) or the number alone. The response's
    number is the one after its last `####`, else its last number; commas and a leading `$` are ignored and
    `72`, `72.0` and `72.` are equal."""
    if not finished:
        return 0.0
    gold = final_number(label)
    if gold is None:
        raise ValueError(f"the label {label!r} holds no number")
    answer = final_number(response)
    return 1.0 if answer is not None and answer == gold else 0.0


def final_number(text: str) -> Decimal | None:
    """The number after the last `####`, else the last number of `text`; None when there is none."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    numbers = _NUMBER.findall(tail.replace("$", ""))
    if not numbers:
        return None
    try:
        return Decimal(numbers[-1 if "####" not in text else 0].replace(",", ""))
    except InvalidOperation:
        return None
