"""Functions a config names: a built-in name, or an import path `pkg.mod:fn` to the user's own."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence


def import_object(field: str, spec: str) -> object:
    """The object at `pkg.mod:name`; errors name the config field."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field}: {spec!r} is not an import path of the form 'pkg.mod:fn'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{field}: cannot import {spec!r}: {exc}") from None
    except SyntaxError as exc:
        raise ValueError(f"{field}: {exc.filename}, line {exc.lineno}: {exc.msg}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed at import: say where, in one line
        raise ValueError(f"{field}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{field}: cannot import {spec!r}: module {module_name!r} has no {attr!r}") from None


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


ALWAYS_ALLOWED = ("miles",)  # the built-ins


def module_allowed(module: str, allowed: Sequence[str]) -> bool:
    """Whether `module` is one of the allowed packages or modules, or inside one."""
    return any(module == name or module.startswith(f"{name}.") for name in (*ALWAYS_ALLOWED, *allowed))


def check_allowed_modules(import_paths: dict[str, str], allowed: Sequence[str], where: str) -> None:
    """Refuse, before any work, every import path outside the allowed modules: one line per field."""
    refused = [
        f"  {field}: module {spec.partition(':')[0]!r} is not allowed"
        for field, spec in import_paths.items()
        if not module_allowed(spec.partition(":")[0], allowed)
    ]
    if refused:
        allowed_list = ", ".join((*ALWAYS_ALLOWED, *allowed))
        raise ImportNotAllowed(f"{where}: imports are allowed only from {allowed_list}:\n" + "\n".join(refused))


class ImportNotAllowed(ValueError):
    """A config names code that the place running it does not allow."""
