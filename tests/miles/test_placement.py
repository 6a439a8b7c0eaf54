"""Placement on GPUs: what Ray assigned, read inside the actors, on a simulated 8-GPU node (Ray's GPU accounting real,
torch on the CPU), and the transport checks against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from miles.placement import Location, check_transport


def _at(node: str, *gpus: str) -> Location:
    return Location(node_id=node, node_ip="127.0.0.1", gpu_ids=gpus, cuda_visible_devices=",".join(gpus))


def test_two_actors_share_a_device_on_one_node_and_one_gpu_id_or_one_uuid():
    assert _at("a", "0").shares_device(_at("a", "0", "1"))
    assert not _at("a", "0").shares_device(_at("b", "0"))  # GPU 0 of another node
    assert not _at("a", "0").shares_device(_at("a", "1"))
    same_uuid = Location("a", "127.0.0.1", ("0",), "0", ("GPU-1234",))
    assert same_uuid.shares_device(Location("a", "127.0.0.1", ("3",), "3", ("GPU-1234",)))


def test_a_transport_the_assigned_placement_cannot_carry_is_refused_at_start():
    sender = _at("a", "0")
    with pytest.raises(RuntimeError, match=r"tensor: trainer rank 0 is on node .*GPU 0, but engine 1: .*GPU 1"):
        check_transport("tensor", sender, [_at("a", "0"), _at("a", "1")])
    with pytest.raises(RuntimeError, match=r"distributed: engines \[0\] share trainer rank 0's GPU"):
        check_transport("distributed", sender, [_at("a", "0"), _at("a", "1")])
    check_transport("tensor", sender, [_at("a", "0")])
    check_transport("distributed", sender, [_at("a", "1"), _at("b", "0")])
    check_transport("disk", sender, [_at("a", "0"), _at("a", "1")])
    check_transport("tensor", _at("a"), [_at("a")])  # on CPUs nothing is mapped across devices


@pytest.mark.slow
def test_runs_on_a_simulated_8_gpu_node_place_engines_on_distinct_gpus_or_pair_them(tiny_model_dir, tmp_path):
    """The sync loop with 4 engines apart from 2 trainer ranks, with 2 engines colocated with 2 ranks, and the
    multi-LoRA loop with two trainer groups, each training on a node of 8 simulated GPUs."""
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
    engines, trainer = gpus(apart["placement"]["engines"]), gpus(apart["placement"]["trainer"])
    assert len(engines) == 4 and len(set(engines)) == 4  # one whole GPU each, never stacked
    assert len(set(trainer)) == 2 and not set(trainer) & set(engines)
    assert apart["placement"]["transport"] == "distributed" and apart["trained"] == [0, 1]

    colocated = report["colocated"]
    engines, trainer = gpus(colocated["placement"]["engines"]), gpus(colocated["placement"]["trainer"])
    assert engines == trainer and len(set(engines)) == 2  # engine i on trainer rank i's GPU, the pairs apart
    assert colocated["placement"]["colocated"] and colocated["trained"] == [0, 1]

    multi_lora = report["multi_lora"]
    engines = gpus(multi_lora["engines"])
    groups = {name: gpus(ranks) for name, ranks in multi_lora["trainer_groups"].items()}
    every = engines + [gpu for ranks in groups.values() for gpu in ranks]
    assert len(engines) == 2 and len(groups) == 2 and len(set(every)) == len(every) == 4
    assert multi_lora["trained"] == {"add": 2, "sub": 2}
