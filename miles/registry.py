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


# The built-ins a config names, by field: each name's import path (imported only when a run resolves it, so that the
# config checks names without importing torch). Adding one is its module plus an entry here; a config may also name
# its own `pkg.mod:name`.
ENGINES = {  # rollout.engine: a class implementing miles.engines.base.RolloutEngine
    "torch": "miles.engines.torch_engine:TorchEngine",
    "sglang": "miles.engines.sglang_engine:SGLangEngine",
}
_ALGORITHMS = "miles.train.algorithms"

ALGORITHMS: dict[str, dict[str, str]] = {
    "advantage_estimator": {
        name: f"{_ALGORITHMS}.advantages:{name}"
        for name in (
            "grpo",
            "dr_grpo",
            "rloo",
            "reinforce_plus_plus",
            "reinforce_plus_plus_sample",
            "reinforce_plus_plus_baseline",
            "gpg",
            "opo",
        )
    }
    # Estimators that need more than the scores (miles.train.algorithms.estimators): remax a greedy response per
    # prompt, gae the critic's values.
    | {"gae": f"{_ALGORITHMS}.estimators:GAE", "remax": f"{_ALGORITHMS}.estimators:ReMax"},
    "policy_loss": {
        name: f"{_ALGORITHMS}.policy_losses:{name}"
        for name in ("ppo_clip", "gspo", "cispo", "gpg", "geo_mean", "sapo", "clip_cov", "kl_cov")
    },
    "kl_estimator": {
        **{name: f"{_ALGORITHMS}.kl:{name}" for name in ("k1", "k2", "k3")},
        "abs": f"{_ALGORITHMS}.kl:absolute",
        "k1+": f"{_ALGORITHMS}.kl:k1_plus",
        "k3+": f"{_ALGORITHMS}.kl:k3_plus",
        # verl's names for the same estimators
        "mse": f"{_ALGORITHMS}.kl:k2",
        "low_var_kl": f"{_ALGORITHMS}.kl:k3",
    },
    "loss_aggregation": {
        name: f"{_ALGORITHMS}.aggregation:{name}"
        for name in ("token_mean", "token_sum", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
    },
}


def check_engine_name(name: str) -> str:
    """`name` if `rollout.engine` may take it (the config's check; the import happens at miles.engines.resolve_engine)."""
    return check_name(name, list(ENGINES))


def check_algorithm_name(kind: str, name: str) -> str:
    """`name` if `algo.<kind>` may take it (the config's check; the import happens at resolve_algorithm)."""
    return check_name(name, list(ALGORITHMS[kind]))
