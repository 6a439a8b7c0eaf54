"""Rollout engines, chosen by `rollout.engine`: a built-in name or 'pkg.mod:Class', as algorithms are.

An engine is one class implementing `miles.engines.base.RolloutEngine` (the calls the InferenceController and the
weight transports make, the weight transports it takes, how it is launched from the config). Adding one is one
module plus one entry in miles.registry.ENGINES (or none: a config names it by import path).
"""

from __future__ import annotations

from miles.registry import ENGINES, import_object


def resolve_engine(name: str) -> type:
    """The engine class `rollout.engine` names: a built-in, or the user's `pkg.mod:Class`."""
    engine = import_object("rollout.engine", ENGINES.get(name, name))
    if not isinstance(engine, type):
        raise ValueError(f"rollout.engine: {name!r} is not a class")
    return engine
