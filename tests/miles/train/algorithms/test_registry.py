"""miles.train.algorithms: the built-ins (miles.registry), name checks, import paths and AlgoConfig's default aggregation."""

from __future__ import annotations

import pytest

from miles.config import AlgoConfig, ConfigError, load_config
from miles.registry import ALGORITHMS, check_algorithm_name
from miles.train.algorithms import (
    Algorithm,
    advantages,
    aggregation,
    kl,
    policy_losses,
    resolve_algorithm,
    resolve_estimator,
)
from miles.train.algorithms.estimators import AdvantageEstimator

KINDS = ["advantage_estimator", "policy_loss", "kl_estimator", "loss_aggregation"]
USER_PATH = "tests.miles.train.algorithms.test_registry:some_fn"


def some_fn(logprobs, old_logprobs, advantages, mask, algo):
    """A user's policy loss, named by import path."""
    return logprobs, mask > 0


def test_builtins_cover_every_kind():
    assert sorted(ALGORITHMS) == sorted(KINDS)
    assert sorted(ALGORITHMS["advantage_estimator"]) == sorted(
        [
            "grpo",
            "dr_grpo",
            "rloo",
            "reinforce_plus_plus",
            "reinforce_plus_plus_sample",
            "reinforce_plus_plus_baseline",
            "gpg",
            "opo",
            "remax",
            "gae",
        ]
    )
    assert sorted(ALGORITHMS["policy_loss"]) == [
        "cispo",
        "clip_cov",
        "geo_mean",
        "gpg",
        "gspo",
        "kl_cov",
        "ppo_clip",
        "sapo",
    ]
    assert sorted(ALGORITHMS["kl_estimator"]) == ["abs", "k1", "k1+", "k2", "k3", "k3+", "low_var_kl", "mse"]
    assert sorted(ALGORITHMS["loss_aggregation"]) == [
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "seq_mean_token_sum_norm",
        "token_mean",
        "token_sum",
    ]


@pytest.mark.parametrize("kind, name", [(kind, name) for kind in KINDS for name in ALGORITHMS[kind]])
def test_every_builtin_resolves_to_a_callable(kind, name):
    fn = resolve_algorithm(kind, name)
    assert callable(fn)
    assert check_algorithm_name(kind, name) == name


@pytest.mark.parametrize(
    "kind, name, expected",
    [
        ("advantage_estimator", "grpo", advantages.grpo),
        ("advantage_estimator", "reinforce_plus_plus_baseline", advantages.reinforce_plus_plus_baseline),
        ("policy_loss", "gspo", policy_losses.gspo),
        ("policy_loss", "cispo", policy_losses.cispo),
        ("kl_estimator", "k1", kl.k1),
        ("kl_estimator", "abs", kl.absolute),
        ("loss_aggregation", "seq_mean_token_sum_norm", aggregation.seq_mean_token_sum_norm),
    ],
)
def test_builtin_is_the_module_function(kind, name, expected):
    assert resolve_algorithm(kind, name) is expected


@pytest.mark.parametrize("alias, target", [("mse", "k2"), ("low_var_kl", "k3")])
def test_verl_aliases_resolve_to_the_same_function(alias, target):
    fn = resolve_algorithm("kl_estimator", alias)
    assert fn is resolve_algorithm("kl_estimator", target)
    assert fn is getattr(kl, target)


def test_import_path_resolves_to_the_user_function():
    assert resolve_algorithm("policy_loss", USER_PATH) is some_fn
    assert check_algorithm_name("policy_loss", USER_PATH) == USER_PATH


def test_import_path_accepted_by_the_config():
    config = load_config(None, [f"algo.policy_loss={USER_PATH}"])
    assert config.algo.policy_loss == USER_PATH
    assert Algorithm.from_config(config.algo).policy_loss is some_fn


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_name_rejected_by_the_config(kind):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"algo.{kind}=nope"])
    message = str(info.value)
    assert f"algo.{kind}" in message
    assert "'nope'" in message
    for name in ALGORITHMS[kind]:
        assert repr(name) in message


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("no_such_package_xyz.mod:fn", "cannot import"),
        ("miles.train.algorithms.kl:no_such_fn", "cannot import"),
        ("miles.train.algorithms.kl:K3_MAX", "not callable"),
        ("miles.train.algorithms.kl:", "not an import path"),
    ],
)
def test_unimportable_path_names_the_field(spec, reason):
    with pytest.raises(ValueError) as info:
        resolve_algorithm("kl_estimator", spec)
    assert "algo.kl_estimator" in str(info.value)
    assert reason in str(info.value)


def test_algorithm_from_config():
    algo = AlgoConfig(advantage_estimator="rloo", policy_loss="cispo", kl_estimator="low_var_kl")
    built = Algorithm.from_config(algo)
    assert built.advantage_estimator.fn is advantages.rloo
    assert built.policy_loss is policy_losses.cispo
    assert built.kl_estimator is kl.k3
    assert built.loss_aggregation is aggregation.token_mean


class CriticBaseline(AdvantageEstimator):
    """A user's estimator that needs a critic, named by import path."""

    needs_critic = True

    def __init__(self, gamma: float):
        self.discount = (gamma, 1.0)

    @classmethod
    def from_algo(cls, algo) -> CriticBaseline:
        return cls(algo.gamma)


@pytest.mark.parametrize(
    ("name", "needs_critic", "needs_greedy_baseline", "discount"),
    [
        ("grpo", False, False, (1.0, 1.0)),
        ("opo", False, False, (1.0, 1.0)),
        ("remax", False, True, (1.0, 1.0)),
        ("gae", True, False, (0.9, 0.8)),
        ("tests.miles.train.algorithms.test_registry:CriticBaseline", True, False, (0.9, 1.0)),
        ("tests.miles.train.algorithms.test_registry:some_fn", False, False, (1.0, 1.0)),
    ],
)
def test_each_estimator_declares_what_it_needs(name, needs_critic, needs_greedy_baseline, discount):
    estimator = resolve_estimator(AlgoConfig(advantage_estimator=name, gamma=0.9, lam=0.8))
    assert (estimator.needs_critic, estimator.needs_greedy_baseline, estimator.discount) == (
        needs_critic,
        needs_greedy_baseline,
        discount,
    )


def test_algorithm_from_config_uses_the_method_aggregation():
    assert Algorithm.from_config(AlgoConfig(policy_loss="gspo")).loss_aggregation is aggregation.seq_mean_token_mean
    built = Algorithm.from_config(AlgoConfig(advantage_estimator="dr_grpo"))
    assert built.loss_aggregation is aggregation.seq_mean_token_sum_norm


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, "token_mean"),  # grpo with ppo_clip
        ({"advantage_estimator": "grpo", "policy_loss": "ppo_clip"}, "token_mean"),
        ({"advantage_estimator": "rloo", "policy_loss": "cispo"}, "token_mean"),
        ({"advantage_estimator": "dr_grpo"}, "seq_mean_token_sum_norm"),
        ({"policy_loss": "gspo"}, "seq_mean_token_mean"),
        ({"advantage_estimator": "dr_grpo", "loss_aggregation": "token_mean"}, "token_mean"),
        ({"policy_loss": "gspo", "loss_aggregation": "seq_mean_token_sum"}, "seq_mean_token_sum"),
        ({"loss_aggregation": "seq_mean_token_mean"}, "seq_mean_token_mean"),
    ],
)
def test_default_aggregation(fields, expected):
    algo = AlgoConfig(**fields)
    assert algo.aggregation == expected
