"""Test helpers: small configs, the SGLang stand-in, and weight comparisons (fixtures are in conftest.py)."""

from __future__ import annotations

from pathlib import Path


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


SGLANG_STAND_IN = "tests.miles.engines.sglang_server"  # launched in place of sglang.launch_server
GPU_ATTENTION_BACKEND = "fa3"  # one that allows --enable-deterministic-inference, as a GPU server's does


def sglang_overrides() -> list[str]:
    """The SGLang engine, served by the stand-in server playing a GPU server: seeded sampling, so that runs compare
    bit for bit (the real server on this CPU cannot seed its sampling: tests/miles/engines/test_sglang_contract.py)."""
    return [
        "rollout.engine=sglang",
        f"rollout.sglang.server_module={SGLANG_STAND_IN}",
        f"rollout.sglang.attention_backend={GPU_ATTENTION_BACKEND}",
        "rollout.sglang.health_timeout_s=5",
    ]


# A model cache shared by the test runs of one `make test` (its halves run apart, one after the other).
TEST_MODELS_VARIABLE = "MILES_TEST_MODELS"
RECOVERY_RUN = dict(num_rollout=5, save_interval=2)  # checkpoints after rollouts 1, 3 and 4


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


def relative_distance(a: dict, b: dict, origin: dict) -> float:
    """|a - b| / |b - origin| over all parameters: how far apart two runs' weights are, as a share of how far they moved
    from `origin`. Adam normalises each step, so rounding-level differences in the gradients can move single weights
    by a good part of the learning rate (a max-abs test is fragile); over the whole model they stay near 1e-3 of the
    distance travelled, while an optimizer step too many or too few is a sizeable share of it."""
    import torch

    assert a.keys() == b.keys() == origin.keys()
    gap = torch.sqrt(sum(((a[k] - b[k]).double() ** 2).sum() for k in a))
    travelled = torch.sqrt(sum(((b[k] - origin[k]).double() ** 2).sum() for k in b))
    return float(gap / travelled)


def weights_directory(model_dir, weights: dict, directory) -> Path:
    """A model directory an engine loads pushed weights from: `model_dir`'s config and tokenizer files, `weights`
    as safetensors (what the trainer's `write_weights` makes for the disk transport)."""
    import shutil

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for path in Path(model_dir).iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            shutil.copy2(path, directory / path.name)
    save_file({k: v.contiguous() for k, v in weights.items()}, directory / "model.safetensors")
    return directory


def weights_probe(model_dir, weights: dict, atol: float = 0.05, dtype: str = "float32"):
    """The push check of `weights` (miles.weights.check), taken here as the trainer takes it, of the weights as
    served in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles.weights.check import take_probe

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(weights)
    return take_probe(model, torch.device("cpu"), atol, dtype)


def weights_push(rollout, model_dir, weights: dict, version: int, directory):
    """The push a controller of `rollout`'s engine takes: tensors through the object store for a TorchEngine, a
    model directory (under `directory`, one per version) for SGLang."""
    import ray

    from miles.cluster.placement import weight_transport
    from miles.rollout.weight_transport import DiskPush, ObjectStorePush

    probe = weights_probe(model_dir, weights)
    from miles.config import TrainConfig

    if weight_transport(rollout, TrainConfig()) == "disk":  # a trainer on the CPU, as in every test
        return DiskPush(weights_directory(model_dir, weights, Path(directory) / str(version)), version, probe)
    return ObjectStorePush(ray.put(weights), version, probe)


def small_llama(vocab: int = 50, **config):
    """A seeded, randomly initialised two-layer Llama of width 32 (config fields may be overridden)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(LlamaConfig(**(shape | config)))


def write_checkpoint(target: Path, rollout_id: int, state: dict, write_files) -> Path:
    """A checkpoint directory as a single trainer worker commits one (`write_files(staging)` fills it)."""
    from miles.state.checkpoint import write_checkpoint_from_ranks

    return write_checkpoint_from_ranks(target, rollout_id, state, 0, write_files)
