"""Placement on GPUs: what Ray assigned, read inside the actors, on a simulated 8-GPU node (Ray's GPU accounting real,
torch on the CPU), and the transport checks against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from miles.cluster.placement import Location, check_transport


def _at(node: str, *gpus: str) -> Location:
    return Location(node_id=node, node_ip="127.0.0.1", gpu_ids=gpus, cuda_visible_devices=",".join(gpus))


def test_two_actors_share_a_device_on_one_node_and_one_gpu_id_or_one_uuid():
    assert _at("a", "0").shares_device(_at("a", "0", "1"))
    assert not _at("a", "0").shares_device(_at("b", "0"))  # GPU 0 of another node
    assert not _at("a", "0").shares_device(_at("a", "1"))
    same_uuid = Location("a", "127.0.0.1", ("0",), "0", ("GPU-1234",))
    assert same_uuid.shares_device(Location("a", "127.0.0.1", ("3",), "3", ("GPU-1234",)))


def test_a_transport_the_assigned_placement_cannot_carry_is_refused_at_start():
    ranks = [_at("a", "0"), _at("a", "1")]
    with pytest.raises(RuntimeError, match=r"tensor: engine 1 is on node .*GPU 1, but the trainer rank that sends it"):
        check_transport("tensor", ranks[:1], [_at("a", "0"), _at("a", "1")], colocated=False)
    with pytest.raises(RuntimeError, match=r"tensor: engine 0 is on node .*GPU 1, but .* is on node .*GPU 0"):
        check_transport("tensor", ranks, [_at("a", "1"), _at("a", "0")], colocated=True)  # pairs crossed
    with pytest.raises(RuntimeError, match=r"distributed: engines \[0\] share trainer rank 0's GPU"):
        check_transport("distributed", ranks[:1], [_at("a", "0"), _at("a", "1")], colocated=False)
    check_transport("tensor", ranks, [_at("a", "0"), _at("a", "1")], colocated=True)  # each on its rank's GPU
    check_transport("tensor", ranks[:1], [_at("a", "0")], colocated=False)
    check_transport("distributed", ranks, [_at("a", "2"), _at("b", "0")], colocated=False)
    check_transport("disk", ranks, [_at("a", "0"), _at("a", "1")], colocated=True)
    check_transport("tensor", [_at("a")], [_at("a"), _at("a")], colocated=False)  # on CPUs no device is mapped


@pytest.mark.slow
def test_runs_on_a_simulated_8_gpu_node_place_engines_on_distinct_gpus_or_pair_them(tiny_model_dir, tmp_path):
    """The sync loop with 4 engines apart from 2 trainer ranks, with 2 SGLang stand-ins colocated with 2 ranks (each
    taking its rank's tensor payloads, and giving its memory to the trainer for each step), and the multi-LoRA loop with two trainer groups, each training on a node of 8
    simulated GPUs."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.simulated_gpus", str(tiny_model_dir), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    def gpus(locations: list[dict]) -> list[str]:
        for location in locations:  # Ray exposes exactly the GPUs it assigned
            assert location["cuda_visible_devices"] == ",".join(location["gpu_ids"])
        return [gpu for location in locations for gpu in location["gpu_ids"]]

    apart = report["apart"]
    engines, trainer = gpus(apart["placement"]["engines"]), gpus(apart["placement"]["trainers"]["policy"])
    assert len(engines) == 4 and len(set(engines)) == 4  # one whole GPU each, never stacked
    assert len(set(trainer)) == 2 and not set(trainer) & set(engines)
    assert apart["placement"]["transport"] == "distributed" and apart["trained"] == [0, 1]

    colocated = report["colocated_sglang"]
    engines, trainer = gpus(colocated["placement"]["engines"]), gpus(colocated["placement"]["trainers"]["policy"])
    assert engines == trainer and len(set(engines)) == 2  # engine i on trainer rank i's GPU, the pairs apart
    assert colocated["placement"]["colocated"] and colocated["trained"] == [0, 1]
    assert colocated["placement"]["transport"] == "tensor"  # each rank hands its engine its payloads
    # Before each train step both engines gave back their KV cache and weights (a push followed each rollout) and
    # refused to generate until the push brought them back; the push check then passed on the refilled weights.
    assert [release["weights"] for release in colocated["releases"]] == [True, True]
    for release in colocated["releases"]:
        assert "released its ['kv_cache', 'weights'] memory; resume_memory" in release["generate"]

    multi_lora = report["multi_lora"]
    engines = gpus(multi_lora["engines"])
    groups = {name: gpus(ranks) for name, ranks in multi_lora["trainer_groups"].items()}
    every = engines + [gpu for ranks in groups.values() for gpu in ranks]
    assert len(engines) == 2 and len(groups) == 2 and len(set(every)) == len(every) == 4
    assert multi_lora["trained"] == {"add": 2, "sub": 2}


SGLANG_CUDA = ["rollout.engine=sglang", "rollout.device=cuda", "train.device=cuda"]
TWO_GROUPS = (
    "adapters=[{name: add, data: {task: addition}, trainer_group: first},"
    " {name: sub, data: {task: subtraction}, trainer_group: second}]"
)
CASES = {
    # every shipped config, on the topology its comment names
    "math-qwen2.5-7b-instruct": ([1, 8], "deployments/configs/math-qwen2.5-7b-instruct.yaml", []),
    "gsm8k-qwen2.5-1.5b-instruct": ([1, 1], "deployments/configs/gsm8k-qwen2.5-1.5b-instruct.yaml", []),
    "tiny": ([1, 0], "deployments/configs/tiny.yaml", []),
    "calculator": ([1, 0], "deployments/configs/calculator.yaml", []),
    # the topologies users run
    "2 GPUs": ([1, 2], None, SGLANG_CUDA),
    "8 GPUs, tp 1": ([1, 8], None, [*SGLANG_CUDA, "rollout.num_engines=6", "train.num_workers=2"]),
    "8 GPUs, tp 2": ([1, 8], None, [*SGLANG_CUDA, "rollout.num_engines=3", "rollout.sglang.tp_size=2", "train.num_workers=2"]),
    "2x8 GPUs": ([2, 8], None, [*SGLANG_CUDA, "rollout.num_engines=4", "rollout.sglang.tp_size=2", "train.num_workers=8", "train.placement=spread"]),
    "8 GPUs, colocated": ([1, 8], None, [*SGLANG_CUDA, "rollout.colocate=true", "rollout.num_engines=8", "train.num_workers=8"]),
    "multi-LoRA, two trainer groups": ([1, 8], None, [*SGLANG_CUDA, TWO_GROUPS, "rollout.num_engines=2", "train.num_workers=2"]),
    "a critic": ([1, 8], None, [*SGLANG_CUDA, "algo.advantage_estimator=gae", "critic.num_workers=2", "train.num_workers=2", "rollout.num_engines=2"]),
    "too few GPUs": ([1, 1], None, SGLANG_CUDA),
}  # fmt: skip


@pytest.fixture(scope="module")
def plans() -> dict[str, dict]:
    """Every case of CASES planned on its simulated cluster (one cluster per shape, in a process of its own)."""
    cases = [{"shape": shape, "config": path, "overrides": overrides} for shape, path, overrides in CASES.values()]
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.plans"],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(CASES, json.loads(done.stdout.strip().splitlines()[-1]), strict=True))


def _gpus(locations: list[dict]) -> list[tuple[str, str]]:
    """(node, GPU id) of every GPU the actors hold; CUDA_VISIBLE_DEVICES is exactly what Ray assigned."""
    for location in locations:
        assert location["cuda_visible_devices"] == (",".join(location["gpu_ids"]) or None)
    return [(location["node_id"], gpu) for location in locations for gpu in location["gpu_ids"]]


@pytest.mark.parametrize("case", [c for c in CASES if c != "too few GPUs"])
def test_each_topology_plans_engines_on_gpus_of_their_own_or_paired(plans, case):
    assert "refused" not in plans[case], plans[case].get("refused")
    record = plans[case]["record"]
    overrides = CASES[case][2]
    engines = [_gpus([engine]) for engine in record["engines"]]
    trainers = {name: [_gpus([rank]) for rank in ranks] for name, ranks in record["trainers"].items()}
    everyone = [gpu for held in engines for gpu in held] + [
        gpu for ranks in trainers.values() for held in ranks for gpu in held
    ]
    if record["colocated"]:
        assert [held for held in engines] == trainers["policy"]  # engine i on trainer rank i's GPU
        assert len(set(everyone)) == len(engines)
        assert record["transport"] == "tensor"  # each rank hands its engine CUDA IPC handles
    else:
        assert len(set(everyone)) == len(everyone)  # no GPU held twice
        if everyone:
            assert record["transport"] == "distributed"
    tp = next((int(o.split("=")[1]) for o in overrides if o.startswith("rollout.sglang.tp_size=")), 1)
    assert all(len(held) == (tp if everyone else 0) for held in engines)


def test_the_plans_place_as_asked_across_nodes_groups_and_the_critic(plans):
    across = plans["2x8 GPUs"]["record"]
    every = across["engines"] + across["trainers"]["policy"]
    assert len({node for held in every for node, _ in _gpus([held])}) == 2 and len(_gpus(every)) == 16
    assert set(plans["multi-LoRA, two trainer groups"]["record"]["trainers"]) == {"first", "second"}
    assert set(plans["a critic"]["record"]["trainers"]) == {"policy", "critic"}
    assert plans["gsm8k-qwen2.5-1.5b-instruct"]["record"]["transport"] == "tensor"


def test_a_run_that_needs_more_gpus_than_the_cluster_has_is_refused_naming_them(plans):
    assert plans["too few GPUs"]["refused"] == (
        "the run asks for 2 GPUs (1 engines of 1, trainer groups policy: 1, rollout.colocate=False); the Ray cluster "
        "has 1"
    )
