"""The algorithm of a run, chosen by name in `algo`: advantage estimator, policy loss, KL estimator and loss
aggregation. Each is a pure tensor function in its kind's module, citing its paper (an advantage estimator that
needs more than the samples' scores is an object: miles.train.algorithms.estimators); a config may name a built-in
or any `pkg.mod:fn` with the same signature (the names: miles.registry.ALGORITHMS)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from miles.registry import ALGORITHMS, import_callable
from miles.train.algorithms.estimators import AdvantageEstimator, ScoreEstimator


def resolve_algorithm(kind: str, name: str) -> Callable:
    """The function `algo.<kind>` names: a built-in, or the user's `pkg.mod:fn`."""
    return import_callable(f"algo.{kind}", ALGORITHMS[kind].get(name, name))


def resolve_estimator(algo) -> AdvantageEstimator:
    """The advantage estimator `algo.advantage_estimator` names: a class deriving AdvantageEstimator is built from
    the algo section; a function is a per-sample estimator."""
    found = resolve_algorithm("advantage_estimator", algo.advantage_estimator)
    if isinstance(found, type) and issubclass(found, AdvantageEstimator):
        return found.from_algo(algo)
    return ScoreEstimator(found, algo.advantage_estimator)


@dataclass(frozen=True)
class Algorithm:
    """What a run's `algo` section names, imported."""

    advantage_estimator: AdvantageEstimator
    policy_loss: Callable
    kl_estimator: Callable
    loss_aggregation: Callable

    @classmethod
    def from_config(cls, algo) -> Algorithm:
        return cls(
            advantage_estimator=resolve_estimator(algo),
            policy_loss=resolve_algorithm("policy_loss", algo.policy_loss),
            kl_estimator=resolve_algorithm("kl_estimator", algo.kl_estimator),
            loss_aggregation=resolve_algorithm("loss_aggregation", algo.aggregation),
        )

    @property
    def needs_critic(self) -> bool:
        """Whether the run trains a critic beside the policy: its values come before `get`, its step after the
        policy's."""
        return self.advantage_estimator.needs_critic
