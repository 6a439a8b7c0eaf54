"""The flow registry: each name the CLI and the deployments use loads its flow and checks its config."""

import pytest

from flows.registry import FLOWS
from miles.config import ConfigError, load_config


def test_each_name_loads_its_prefect_flow():
    assert list(FLOWS) == ["sync", "async", "fully-async", "multi-lora"]
    for name, rl_flow in FLOWS.items():
        assert rl_flow.load().name == f"rl-{name}"


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("async", ["algo.use_tis=false"], "the async flows train off-policy"),
        ("fully-async", ["algo.use_tis=false"], "the async flows train off-policy"),
        ("fully-async", ["algo.dynamic_sampling=true"], "algo.dynamic_sampling: the fully-async flow"),
        ("multi-lora", ["model.path=/models/base"], "the multi-LoRA flow needs at least one adapter"),
        ("sync", ["model.path=/m", "data.task=null", "data.path=/no/such/prompts.jsonl"], "/no/such/prompts.jsonl"),
    ],
)
def test_each_flow_rejects_what_it_cannot_run_before_any_work(name, overrides, message):
    with pytest.raises(ConfigError, match=message):
        FLOWS[name].check(load_config(None, overrides))
    FLOWS["sync"].check(load_config(None))  # the default config runs
