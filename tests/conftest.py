"""Shared fixtures: one tiny model, one Ray and one Prefect test API per session (each start costs seconds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache) -> Path:
    """The embedded model with a short warm-up: real weights and tokenizer, built in seconds."""
    from miles.config import ModelConfig, WarmupConfig
    from miles.models import ensure_embedded_model

    config = ModelConfig(warmup=WarmupConfig(max_steps=100, eval_every=100, target_accuracy=1.0))
    return ensure_embedded_model(config, ["addition"], seed=0, cache_root=model_cache)


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

    from miles.cluster import ensure_ray

    ensure_ray(None, actors=3)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield


def small_overrides(model_dir: Path) -> list[str]:
    """Config overrides that make an iteration take well under a second on the tiny model."""
    return [
        f"model.path={model_dir}",
        "rollout.rollout_batch_size=8",
        "rollout.n_samples_per_prompt=4",
        "rollout.num_threads=1",
        "train.global_batch_size=16",
        "train.micro_batch_size=8",
        "train.num_threads=1",
        "train.lr=1e-3",
        # Partial credit, so that the barely warmed-up model's groups have reward variance to learn from.
        "data.reward=digit_match",
    ]


def small_config_for(model_dir: Path, run_dir: Path, *overrides: str, **fields):
    from miles.config import load_config

    fields.setdefault("num_rollout", 2)
    return load_config(None, small_overrides(model_dir) + list(overrides), run_dir=str(run_dir), **fields)


@pytest.fixture
def small_config(tmp_path, tiny_model_dir):
    def make(*overrides: str, **fields):
        return small_config_for(tiny_model_dir, fields.pop("run_dir", tmp_path / "run"), *overrides, **fields)

    return make


SGLANG_STAND_IN = "tests.miles.engines.sglang_server"  # launched in place of sglang.launch_server


def sglang_overrides() -> list[str]:
    """The SGLang engine, served by the stand-in server (SGLang itself needs a GPU)."""
    return ["rollout.engine=sglang", f"rollout.sglang.server_module={SGLANG_STAND_IN}", "rollout.sglang.health_timeout_s=5"]


RECOVERY_RUN = dict(num_rollout=5, save_interval=2)  # checkpoints after rollouts 1, 3 and 4


@pytest.fixture(scope="session")
def uninterrupted_weights(ray_session, tiny_model_dir, tmp_path_factory):
    """The final weights of an uninterrupted sync run of RECOVERY_RUN: what a recovered run must end with."""
    from miles.loop import run_sync

    config = small_config_for(tiny_model_dir, tmp_path_factory.mktemp("uninterrupted") / "run", **RECOVERY_RUN)
    run_sync(config)
    return final_weights(config.run_dir, RECOVERY_RUN["num_rollout"] - 1)


def perturbed_weights(model_dir, seed: int, scale: float) -> dict:
    """The model's state dict with noise added to each parameter; tied parameters stay tied, as a trainer's are."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():  # a tied parameter is listed once
            parameter.add_(scale * torch.randn(parameter.shape, generator=gen))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def final_weights(run_dir, rollout_id: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "checkpoints" / str(rollout_id) / "model" / "model.safetensors"))


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
