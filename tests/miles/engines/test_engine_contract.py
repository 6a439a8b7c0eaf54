"""Every registered engine against the RolloutEngine protocol, and the registry that chooses one."""

from __future__ import annotations

import pytest

from miles.cluster.placement import weight_transport
from miles.config import load_config
from miles.engines import resolve_engine
from miles.registry import ENGINES
from tests.helpers.engine_contract import contract_violations


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_built_in_engine_offers_the_whole_protocol(name):
    assert contract_violations(resolve_engine(name)) == []


class HalfAnEngine:
    weight_transports = ("disk", "carrier_pigeon")

    def generate(self, prompts): ...

    def update_weights_from_disk(self, directory: str, version: int) -> None: ...


def test_an_engine_that_falls_short_is_told_where():
    problems = contract_violations(HalfAnEngine)
    expected = (
        "weight_transports ('disk', 'carrier_pigeon'): one or more of ['disk', 'distributed', 'object_store', 'tensor']"
    )
    assert expected in (problems)
    assert "no distributed_load_format" in problems and "no launch_args" in problems and "no health" in problems
    assert any(p.startswith("generate(self, prompts) does not take generate(self, requests") for p in problems)
    assert not any("update_weights_from_disk" in p for p in problems)  # it takes the call of the transport it names


def test_an_engine_is_named_by_import_path_like_an_algorithm():
    config = load_config(None, ["rollout.engine=miles.engines.torch_engine:TorchEngine"])
    assert resolve_engine(config.rollout.engine) is resolve_engine("torch")
    assert config.import_paths()["rollout.engine"] == "miles.engines.torch_engine:TorchEngine"


def test_an_unknown_engine_is_refused_naming_the_built_ins():
    with pytest.raises(ValueError, match=r"unknown 'vllm'; use one of \['sglang', 'torch'\] or 'pkg.mod:fn'"):
        load_config(None, ["rollout.engine=vllm"])


@pytest.mark.parametrize(
    "overrides, transport",
    [
        ([], "object_store"),
        (["rollout.engine=sglang"], "disk"),
        (["rollout.engine=sglang", "rollout.weight_transport=distributed"], "distributed"),
        (["rollout.weight_transport=disk"], "disk"),
    ],
)
def test_the_weight_transport_is_the_engines_choice_unless_set(overrides, transport):
    config = load_config(None, overrides)
    assert weight_transport(config.rollout, config.train) == transport


def test_a_transport_the_engine_does_not_take_is_named():
    config = load_config(None, ["rollout.engine=sglang", "rollout.weight_transport=object_store"])
    with pytest.raises(
        ValueError, match=r"object_store: the sglang engine \(SGLangEngine\) takes disk or tensor or distributed"
    ):
        weight_transport(config.rollout, config.train)


CUDA_BOTH = ["rollout.device=cuda", "train.device=cuda"]
COLOCATED = [*CUDA_BOTH, "rollout.colocate=true"]


@pytest.mark.parametrize(
    "overrides, transport",
    [
        (["rollout.engine=sglang", *CUDA_BOTH], "distributed"),  # GPUs of their own: a broadcast over NCCL
        (["rollout.engine=sglang", *CUDA_BOTH, "rollout.sglang.tp_size=2"], "distributed"),
        (["rollout.engine=sglang", "rollout.device=cuda"], "disk"),  # a CPU trainer
        ([*CUDA_BOTH], "distributed"),
        (["rollout.engine=sglang", *COLOCATED], "tensor"),  # on trainer rank 0's GPU: CUDA IPC
        # each rank hands the engine on its own GPU its payloads
        (["rollout.engine=sglang", *COLOCATED, "rollout.num_engines=2", "train.num_workers=2"], "tensor"),
        ([*COLOCATED], "object_store"),  # the TorchEngine takes no tensor payloads
    ],
)
def test_the_default_transport_follows_the_placement(overrides, transport):
    config = load_config(None, overrides)
    assert weight_transport(config.rollout, config.train) == transport


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.engine=sglang", *COLOCATED, "rollout.weight_transport=distributed"],
            r"rollout.weight_transport=distributed: with rollout.device=cuda, train.device=cuda, rollout.colocate=True, "
            r"engine 0 shares trainer rank 0's GPU, and NCCL refuses a group with two ranks on one GPU; use tensor",
        ),
        (
            ["rollout.engine=sglang", *CUDA_BOTH, "rollout.weight_transport=tensor"],
            r"CUDA IPC handles to a trainer rank's memory, which only an engine on that rank's GPU can map; .* the "
            r"engines are on GPUs of their own: use distributed, or colocate them",
        ),
        (
            ["rollout.engine=sglang", "rollout.sglang.tp_size=2", "rollout.weight_transport=tensor"],
            r"rollout.weight_transport=tensor sends one payload per bucket, for an engine of one GPU: "
            r"rollout.sglang.tp_size=2",
        ),
        (["rollout.colocate=true"], r"rollout.colocate=true .* needs rollout.device and train.device on cuda"),
        (
            [*COLOCATED, "rollout.num_engines=2"],
            r"rollout.num_engines=2 must equal train.num_workers=1",
        ),
        (
            ["rollout.engine=sglang", *COLOCATED, "rollout.sglang.tp_size=2"],
            r"an engine of 2 GPUs \(rollout.sglang.tp_size\) cannot be colocated",
        ),
    ],
)
def test_an_impossible_transport_or_placement_is_refused_naming_the_fields(overrides, message):
    config = load_config(None, overrides)
    with pytest.raises(ValueError, match=message):
        weight_transport(config.rollout, config.train)
