"""miles.registry: which import paths a config names, and the allow-list that refuses the rest."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from control.policy import ImportNotAllowed, check_allowed_modules, module_allowed
from miles.config import IMPORT_PATH, RunConfig, load_config
from miles.config.base import has_mark


def test_a_config_lists_every_import_path_it_names_by_field():
    config = load_config(
        None,
        [
            "data.reward=my_rewards.math:score",
            "rollout.env=my_envs:Guess",
            "rollout.generate_fn=my_gen:produce",
            "algo.advantage_estimator=my_algos:advantages",
            "algo.policy_loss=my_algos:loss",
            "algo.loss_aggregation=my_algos:aggregate",
            "algo.kl_estimator=my_algos:kl",
        ],
        eval={"datasets": [{"name": "held-out", "task": "addition", "reward": "my_eval:score"}]},
        adapters=[{"name": "a", "data": {"task": "addition", "reward": "adapter_rewards:score"}}],
    )
    assert config.import_paths() == {
        "data.reward": "my_rewards.math:score",
        "rollout.env": "my_envs:Guess",
        "rollout.generate_fn": "my_gen:produce",
        "algo.advantage_estimator": "my_algos:advantages",
        "algo.policy_loss": "my_algos:loss",
        "algo.loss_aggregation": "my_algos:aggregate",
        "algo.kl_estimator": "my_algos:kl",
        "eval.datasets.0.reward": "my_eval:score",
        "adapters.0.data.reward": "adapter_rewards:score",
    }
    assert RunConfig().import_paths() == {}  # built-in names are not import paths


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in getattr(annotation, "__args__", ()) for model in _models_in(arg)]


def _fields_naming_code(model: type[BaseModel], prefix: str = "") -> dict[str, bool]:
    """Every field whose description offers 'pkg.mod:...', and whether it carries the IMPORT_PATH mark."""
    found = {}
    for name, info in model.model_fields.items():
        for sub in _models_in(info.annotation):
            found |= _fields_naming_code(sub, f"{prefix}{name}.")
        if "pkg.mod:" in (info.description or ""):
            found[f"{prefix}{name}"] = has_mark(info, IMPORT_PATH)
    return found


def test_every_field_that_takes_an_import_path_is_marked_so_the_allow_list_sees_it():
    fields = _fields_naming_code(RunConfig)
    assert {"data.reward", "rollout.env", "rollout.generate_fn", "algo.policy_loss", "eval.datasets.reward"} <= set(
        fields
    )
    assert all(fields.values()), [field for field, marked in fields.items() if not marked]


@pytest.mark.parametrize(
    ("module", "allowed"),
    [("miles.rewards", True), ("my_pkg", True), ("my_pkg.sub.mod", True), ("my_pkgx", False), ("os", False)],
)
def test_a_module_is_allowed_when_it_is_or_lies_inside_an_allowed_one(module, allowed):
    assert module_allowed(module, ["my_pkg"]) is allowed


def test_a_refusal_names_each_field_and_module_outside_the_allow_list():
    paths = {"data.reward": "os:system", "algo.policy_loss": "my_pkg.losses:clip", "rollout.env": "evil.envs:Shell"}
    with pytest.raises(ImportNotAllowed) as refused:
        check_allowed_modules(paths, ["my_pkg"], "deployment rl-sync/tiny")
    assert str(refused.value) == (
        "deployment rl-sync/tiny: imports are allowed only from miles, my_pkg:\n"
        "  data.reward: module 'os' is not allowed\n"
        "  rollout.env: module 'evil.envs' is not allowed"
    )
    check_allowed_modules({"data.reward": "miles.rewards:exact_match"}, [], "anywhere")
