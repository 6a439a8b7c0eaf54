"""The algorithm of a run, chosen by name in `algo`: advantage estimator, policy loss, KL estimator and loss
aggregation. Each is a pure tensor function in its kind's module, citing its paper; a config may name a built-in
or any `pkg.mod:fn` with the same signature. This module imports no torch, so the config can check names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from miles.registry import check_name, import_callable

_HERE = __name__

BUILTINS: dict[str, dict[str, str]] = {
    "advantage_estimator": {
        name: f"{_HERE}.advantages:{name}"
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
    # Their own paths in the rollout executor: gae over tokens with the critic's values, remax with greedy baselines.
    | {"gae": f"{_HERE}.value:gae", "remax": f"{_HERE}.advantages:remax"},
    "policy_loss": {
        name: f"{_HERE}.policy_losses:{name}"
        for name in ("ppo_clip", "gspo", "cispo", "gpg", "geo_mean", "sapo", "clip_cov", "kl_cov")
    },
    "kl_estimator": {
        **{name: f"{_HERE}.kl:{name}" for name in ("k1", "k2", "k3")},
        "abs": f"{_HERE}.kl:absolute",
        "k1+": f"{_HERE}.kl:k1_plus",
        "k3+": f"{_HERE}.kl:k3_plus",
        # verl's names for the same estimators
        "mse": f"{_HERE}.kl:k2",
        "low_var_kl": f"{_HERE}.kl:k3",
    },
    "loss_aggregation": {
        name: f"{_HERE}.aggregation:{name}"
        for name in ("token_mean", "token_sum", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
    },
}


def check_algorithm_name(kind: str, name: str) -> str:
    """`name` if `algo.<kind>` may take it (the config's check; the import happens at resolve_algorithm)."""
    return check_name(name, list(BUILTINS[kind]))


def resolve_algorithm(kind: str, name: str) -> Callable:
    """The function `algo.<kind>` names: a built-in, or the user's `pkg.mod:fn`."""
    return import_callable(f"algo.{kind}", BUILTINS[kind].get(name, name))


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
