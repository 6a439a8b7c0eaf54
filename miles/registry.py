"""Functions a config names: a built-in name, or an import path `pkg.mod:fn` to the user's own."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def import_object(field: str, spec: str) -> object:
    """The object at `pkg.mod:name`; errors name the config field."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field}: {spec!r} is not an import path of the form 'pkg.mod:fn'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field}: cannot import {spec!r}: {exc}") from exc


def import_callable(field: str, spec: str) -> Callable:
    """The callable at `pkg.mod:fn`; errors name the config field."""
    fn = import_object(field, spec)
    if not callable(fn):
        raise ValueError(f"{field}: {spec!r} is not callable")
    return fn


def check_name(name: str, builtins: list[str]) -> str:
    """`name` if it is a built-in or has the shape of an import path, else an error that lists the built-ins (the
    caller names the field)."""
    if name in builtins or ":" in name:
        return name
    raise ValueError(f"unknown {name!r}; use one of {sorted(builtins)} or 'pkg.mod:fn'")
