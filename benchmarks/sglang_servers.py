"""Which SGLang server a benchmark drives: the real one on this CPU (MILES_SGLANG_PYTHON, set by `make test`, or
`--python`; `make install-sglang-cpu` builds its environment), else the tests' stand-in."""

from __future__ import annotations

import argparse
import os

from miles.config import SGLangConfig

STAND_IN = "tests.miles.engines.sglang_server"


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--python",
        default=os.environ.get("MILES_SGLANG_PYTHON"),
        help="the Python of the real SGLang server's environment (default: MILES_SGLANG_PYTHON); unset: the stand-in",
    )


def server_config(args: argparse.Namespace) -> tuple[str, SGLangConfig]:
    """(a name for the report, the engine's config)."""
    if args.python:
        return "real SGLang 0.5.23", SGLangConfig(python=args.python, startup_timeout_s=300)
    return "the stand-in (no MILES_SGLANG_PYTHON)", SGLangConfig(server_module=STAND_IN)
