"""Answer checkers for math data: `math` (math-verify) and `gsm8k` (the `#### <number>` convention).

Both score 1.0 for a right final answer and 0.0 otherwise, and 0.0 for a response cut at max_new_tokens
(`finished` False): it never finished its answer.
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal, InvalidOperation

from math_verify import parse, verify

# The rewards run in worker threads, where math-verify's own time limits (SIGALRM) cannot work; the scorer's
# data.reward_timeout_s bounds every call instead, so the library's notice that its limits are off is noise.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).setLevel(logging.ERROR)

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def math_answer(response: str, label: str, finished: bool) -> float:
    """1.0 when the response's final answer equals the label mathematically (math-verify, Hugging Face).

    The answer is the response's last `\\boxed{...}`, else its last LaTeX or plain expression; the label is
    parsed as a LaTeX expression (`$...$` is added when it has no delimiters). Equivalent forms score alike:
    `1/2`, `0.5`, `\\frac{1}{2}`, `\\dfrac12`; `2\\sqrt{2}` and `\\sqrt{8}`; `x^2+2x+1` and `(x+1)^2`; sets in any
    order; `1,000` and `1000`. Numbers are compared after rounding to 6 decimals (math-verify's default)."""
    if not finished:
        return 0.0
    gold = parse(label if "$" in label or "\\boxed" in label else f"${label}$", parsing_timeout=None)
    if not gold:
        raise ValueError(f"the label {label!r} is not an expression math-verify can parse")
    answer = parse(response, parsing_timeout=None)
    return 1.0 if answer and verify(gold, answer, timeout_seconds=None) else 0.0


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
