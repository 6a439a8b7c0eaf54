"""Shared fixtures: one tiny model, one Ray and one Prefect test API per session (each start costs seconds).

Plain helpers (configs, weights, faults) live in tests.helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import RECOVERY_RUN, TEST_MODELS_VARIABLE, final_weights, small_config_for

# Two test workers on two cores run more torch threads than there are cores: OpenMP threads that spin while they
# wait burn the CPU the other worker's threads need (a step took 3 times as long). Asleep while they wait, they make
# the same updates (the threads and their work are unchanged). Set before torch loads, for every process started here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")

# `--fast` (make test-fast, the inner loop) leaves out what starts a cluster, a workflow server, a real model or a
# subprocess run: the end-to-end and benchmark directories, the marked tests, and every test that takes one of these
# fixtures (found by the fixtures a test asks for, so a new test is sorted without a list to keep).
SLOW_DIRECTORIES = ("tests/e2e/", "tests/benchmarks/")
SLOW_MARKERS = ("slow", "slow_smoke", "sglang_contract")
SLOW_FIXTURES = {"ray_session", "prefect_api", "real_model_dir", "instruct_model_dir", "uninterrupted_weights"}


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true", help="only the tests that start no cluster, server or run")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--fast"):
        return
    slow, fast = [], []
    for item in items:
        path = Path(str(item.fspath)).relative_to(config.rootpath).as_posix()
        heavy = (
            path.startswith(SLOW_DIRECTORIES)
            or any(item.get_closest_marker(marker) for marker in SLOW_MARKERS)
            or SLOW_FIXTURES & set(item.fixturenames)
        )
        (slow if heavy else fast).append(item)
    config.hook.pytest_deselected(items=slow)
    items[:] = fast


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory, worker_id) -> Path:
    """One model cache for the session's pytest-xdist workers: each model is built once, by the first worker that
    needs it, while the others wait for it (miles.models.tiny.ensure_embedded_model). `make test` names one for both
    of its pytest runs in MILES_TEST_MODELS."""
    if shared := os.environ.get(TEST_MODELS_VARIABLE):
        return Path(shared)
    root = tmp_path_factory.getbasetemp()
    path = (root if worker_id == "master" else root.parent) / "model-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache) -> Path:
    """The embedded model with a short warm-up: real weights and tokenizer, built in seconds."""
    from miles.config import ModelConfig, WarmupConfig
    from miles.models import ensure_embedded_model

    config = ModelConfig(warmup=WarmupConfig(max_steps=100, eval_every=100, target_accuracy=1.0))
    return ensure_embedded_model(config, ["addition"], seed=0, cache_root=model_cache)


@pytest.fixture(scope="session")
def bf16_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The embedded model stored in bfloat16, as pretrained models ship (its embedding and output head tied)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = tmp_path_factory.mktemp("bf16") / "model"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def instruct_model_dir(tmp_path_factory) -> Path:
    """A model directory like a pretrained instruct model's (tests/helpers/instruct_model.py): a 32k BPE vocabulary,
    ChatML, <|im_end|> in generation_config.json, bf16 weights; about 25 s to build."""
    from tests.helpers.instruct_model import build_instruct_model

    return build_instruct_model(tmp_path_factory.mktemp("instruct") / "model")


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct, a real pretrained instruct model (tests/helpers/real_model.py): built once per machine
    by `make real-model`, which `make test` runs before naming the directory in MILES_REAL_MODEL."""
    directory = os.environ.get("MILES_REAL_MODEL")
    if not directory:
        pytest.skip("the real model needs MILES_REAL_MODEL (make real-model; make test sets it)")
    if not Path(directory).is_dir():
        pytest.fail(f"MILES_REAL_MODEL={directory} does not exist: run make real-model")
    return Path(directory)


@pytest.fixture(scope="session")
def tool_model_dir(model_cache) -> Path:
    """The embedded model of the sums task, with the calculator's tokens, after a third of its shipped warm-up: it
    calls the calculator in its episodes already, and is built in a quarter of the time."""
    from miles.config import ModelConfig, WarmupConfig
    from miles.models import ensure_embedded_model

    config = ModelConfig(warmup=WarmupConfig(max_steps=100, eval_every=100, target_accuracy=1.0))
    return ensure_embedded_model(config, ["sums"], seed=0, cache_root=model_cache)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def make_lora(tiny_model_dir):
    """(PEFT state dict, adapter_config.json contents) of a LoRA adapter whose lora_B is random, not zero."""
    import torch
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from miles.config import AdapterConfig
    from miles.train.lora import config_dict, lora_config

    def make(seed: int, rank: int = 8, scale: float = 0.5):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        torch.manual_seed(seed)
        model = get_peft_model(base, lora_config(AdapterConfig(name="x", rank=rank)))
        gen = torch.Generator().manual_seed(seed)
        tensors = {
            k: (torch.randn(v.shape, generator=gen) * scale if "lora_B" in k else v.detach().clone())
            for k, v in get_peft_model_state_dict(model).items()
        }
        assert any("lora_B" in k for k in tensors) and any("lora_A" in k for k in tensors)
        return tensors, config_dict(model.peft_config["default"])

    return make


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from miles.cluster.actors import ensure_ray

    ensure_ray(None, actors=5)  # room for two trainer groups of two workers beside an engine
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield


@pytest.fixture
def small_config(tmp_path, tiny_model_dir):
    def make(*overrides: str, **fields):
        return small_config_for(tiny_model_dir, fields.pop("run_dir", tmp_path / "run"), *overrides, **fields)

    return make


@pytest.fixture(scope="session")
def uninterrupted_weights(ray_session, tiny_model_dir, tmp_path_factory):
    """The final weights of an uninterrupted sync run of RECOVERY_RUN: what a recovered run must end with."""
    from miles.loop import run_sync

    config = small_config_for(tiny_model_dir, tmp_path_factory.mktemp("uninterrupted") / "run", **RECOVERY_RUN)
    run_sync(config)
    return final_weights(config.run_dir, RECOVERY_RUN["num_rollout"] - 1)
