"""The algorithm of a run, chosen by name in `algo`: advantage estimator, policy loss, KL estimator and loss
aggregation. Each is a pure tensor function in its kind's module, citing its paper; a config may name a built-in
or any `pkg.mod:fn` with the same signature (the names: miles.registry.ALGORITHMS)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from miles.registry import ALGORITHMS, import_callable


def resolve_algorithm(kind: str, name: str) -> Callable:
    """The function `algo.<kind>` names: a built-in, or the user's `pkg.mod:fn`."""
    return import_callable(f"algo.{kind}", ALGORITHMS[kind].get(name, name))


@dataclass(frozen=True)
class Algorithm:
    """The functions a run's `algo` section names, imported."""

    advantage_estimator: Callable
    policy_loss: Callable
    kl_estimator: Callable
    loss_aggregation: Callable

    @classmethod
    def from_config(cls, algo) -> Algorithm:
        return cls(
            advantage_estimator=resolve_algorithm("advantage_estimator", algo.advantage_estimator),
            policy_loss=resolve_algorithm("policy_loss", algo.policy_loss),
            kl_estimator=resolve_algorithm("kl_estimator", algo.kl_estimator),
            loss_aggregation=resolve_algorithm("loss_aggregation", algo.aggregation),
        )
