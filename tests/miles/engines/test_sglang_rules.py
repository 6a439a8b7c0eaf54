"""SGLang's own rules, on this CPU: the launch commands SGLangEngine builds and the request bodies it POSTs, checked
by SGLang 0.5.23's own code (tests/helpers/sglang_rules.py, run once by the Python of SGLang's environment).

Each launch command goes through what `python -m sglang.launch_server` does with its argv before it starts anything:
its parser, ServerArgs' resolution and validation, and its server-argument checks; a GPU command sees the device facts
of H100 80GB GPUs. Each body goes through the server's own parse into its request class, and the normalization and
sampling-parameter checks a /generate body gets. So a flag or a request field that SGLang renames, drops or starts to
refuse fails here, without a server or a GPU. MILES_SGLANG_PYTHON names SGLang's Python (make install-sglang-cpu;
`make test` sets it); without it the module is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from miles.cluster.memory_budget import colocated_engine_share
from miles.config import AdapterConfig, ModelConfig, RolloutConfig, SGLangConfig, load_config
from miles.engines import sglang_engine
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.sglang_engine import CPU_KV_CACHE_TOKENS, SGLangEngine
from miles.models.tiny import build_tiny_model
from miles.weights.group import FLATTENED, WeightGroup
from miles.weights.payload import serialize_bucket
from tests.helpers.sglang_rules import H100_MEMORY_MIB

pytestmark = pytest.mark.sglang_contract

# The buckets of the engine's tensor push here: one tensor, and mixed dtypes with an odd size between them.
_values = torch.Generator().manual_seed(0)
TENSOR_BUCKETS = [
    {"model.norm.weight": torch.ones(4)},
    {
        "model.layers.0.input_layernorm.weight": torch.randn(7, generator=_values).bfloat16(),
        "model.embed_tokens.weight": torch.randn(3, 5, generator=_values),
        "model.layers.0.mlp.up_proj.weight": torch.randn(5, 3, generator=_values).half(),
    },
]

REAL_PYTHON = os.environ.get("MILES_SGLANG_PYTHON")
ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "tests" / "helpers" / "sglang_rules.py"
PRESETS = sorted(
    path.name
    for path in (ROOT / "deployments" / "configs").glob("*.yaml")
    if load_config(path).rollout.engine == "sglang"
)
# Every endpoint SGLangEngine POSTs to. The prefix cache is flushed by the `flush_cache` field of its weight loads: it
# POSTs no /flush_cache.
ENDPOINTS = {
    "/generate",
    "/pause_generation",
    "/continue_generation",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/weights_checker",
    "/release_memory_occupation",
    "/resume_memory_occupation",
}
TINY_VOCAB = 16


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Model directories for the config.json SGLang reads while it resolves its arguments: the embedded model's
    (float32, with its weights), and one shaped like Qwen2.5-1.5B-Instruct's (bfloat16, its config alone: nothing
    loads weights here), standing in for the presets' models."""
    from transformers import Qwen2Config

    root = tmp_path_factory.mktemp("sglang-rules")
    tiny = root / "tiny"
    build_tiny_model(ModelConfig(), vocab_size=TINY_VOCAB, seed=0).save_pretrained(tiny)
    qwen = root / "qwen2.5-1.5b"
    Qwen2Config(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        torch_dtype="bfloat16",
    ).save_pretrained(qwen)
    return {"tiny": tiny, "qwen": qwen}


def _started(start_engine) -> tuple[list[str], dict | None]:
    """The command and environment SGLangEngine starts its server with: its own __init__ runs, with a server process
    that exits at once (the engine then gives up and cleans up)."""
    started = []

    class Exited:
        pid = 0

        def poll(self) -> int:
            return 1

    def popen(command, **kwargs):
        started.append((command, kwargs.get("env")))
        return Exited()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sglang_engine.subprocess, "Popen", popen)
        with pytest.raises(RuntimeError, match="exited with code 1 while starting"):
            start_engine()
    [(command, environment)] = started
    return command, environment


def _from_config(model_dir: Path, rollout: RolloutConfig, adapters=(), weight_version: int = 0):
    """An engine of the run's config, made as the InferenceController makes one (launch_args)."""
    return _started(lambda: SGLangEngine(**SGLangEngine.launch_args(str(model_dir), weight_version, rollout, adapters)))


def _rollout(*overrides: str) -> RolloutConfig:
    return load_config(None, ["rollout.engine=sglang", *overrides]).rollout


def _launch_commands(model_dirs) -> dict[str, tuple[list[str], dict | None]]:
    tiny, qwen = model_dirs["tiny"], model_dirs["qwen"]
    launches = {
        name: _from_config(qwen, load_config(ROOT / "deployments" / "configs" / name).rollout) for name in PRESETS
    }
    # The contract suite's real CPU server (test_sglang_contract.py), made as it makes it.
    contract = SGLangConfig(python=REAL_PYTHON, health_timeout_s=30, startup_timeout_s=300)
    launches["cpu-contract"] = _started(
        lambda: SGLangEngine(str(tiny), weight_version=3, device="cpu", config=contract, timeout_s=120)
    )
    launches["float32-gpu"] = _from_config(tiny, _rollout("rollout.device=cuda", "rollout.dtype=float32"), (), 2)
    launches["colocated"] = _from_config(
        qwen, _rollout("rollout.device=cuda", "rollout.colocate=true", "rollout.sglang.mem_fraction_static=0.5")
    )
    # Its share derived from what the trainer rank beside it keeps (16 GiB) on an H100 (80 GiB, as CUDA reports it).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sglang_engine, "gpu_memory_bytes", lambda: H100_MEMORY_MIB * 2**20)
        colocated = _rollout("rollout.device=cuda", "rollout.colocate=true")
        launches["colocated-derived"] = _started(
            lambda: SGLangEngine(**SGLangEngine.launch_args(str(qwen), 0, colocated, (), 16 * 2**30))
        )
    adapters = [AdapterConfig(name="math", rank=8), AdapterConfig(name="code", rank=16, target_modules=["q_proj"])]
    launches["lora-tp2"] = _from_config(
        qwen,
        _rollout("rollout.device=cuda", "rollout.sglang.tp_size=2", "rollout.max_running_requests=64"),
        adapters,
    )
    return launches


def _probes(launches) -> dict[str, list[str]]:
    """The project's own commands, each changed as one of its choices says SGLang would not take it: the reasons for
    those choices, pinned."""
    cpu = _argv(launches["cpu-contract"][0])
    float32 = _argv(launches["float32-gpu"][0])
    backend = float32.index("--attention-backend")
    return {
        # NONDETERMINISTIC_BACKENDS: SGLang refuses deterministic inference with torch_native, the CPU's backend.
        "cpu-deterministic": [*cpu, "--enable-deterministic-inference"],
        # FLOAT32_BACKENDS: left to choose for a deterministic float32 server on an H100, SGLang picks fa3, which
        # takes 16-bit weights only (its kernels refuse float32; its argument checks do not); hence the explicit
        # triton.
        "float32-sglang-choice": float32[:backend] + float32[backend + 2 :],
    }


def _argv(command: list[str]) -> list[str]:
    assert command[1:3] == ["-m", "sglang.launch_server"], command
    return command[3:]


class _Running:
    pid = 0

    def poll(self) -> None:
        return None


def _answer(path: str, body: dict) -> object:
    """What a server answers, enough for the engine's methods to go on."""
    if path == "/generate" and isinstance(body["input_ids"][0], list):
        meta = {"output_token_logprobs": [[-0.5, 3, None]], "finish_reason": {"type": "length"}, "weight_version": "0"}
        return [{"meta_info": meta} for _ in body["input_ids"]]
    if path == "/generate":
        pairs = [[None, body["input_ids"][0], None]] + [[-0.5, t, None] for t in body["input_ids"][1:]]
        return {"meta_info": {"input_token_logprobs": pairs}}
    if path == "/weights_checker":
        return {"success": True, "message": "", "per_engine_checksum": "0" * 64}
    return {"success": True, "message": ""}


def _request_bodies(tmp_path: Path) -> list[tuple[str, dict]]:
    """Every body SGLangEngine's own methods POST, as they go on the wire: an engine made without a server, its HTTP
    client answered in place of one."""
    sent: list[tuple[str, dict]] = []

    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append((request.url.path, body))
        return httpx.Response(200, json=_answer(request.url.path, body))

    engine = object.__new__(SGLangEngine)
    engine.model_dir, engine.url, engine.timeout_s = tmp_path, "http://127.0.0.1:9", 30.0
    engine.config, engine.pause_generation_mode = SGLangConfig(), "retract"
    engine._weight_version, engine._adapter_versions, engine._weight_group, engine._open_push = 0, {}, None, None
    engine._released, engine._releases_on_server = set(), True  # a colocated server on a GPU
    engine._work_dir, engine._log_path, engine._process = tmp_path, tmp_path / "server.log", _Running()
    engine._http = httpx.Client(base_url=engine.url, transport=httpx.MockTransport(server))

    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, stop_token_ids=(2,))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    seed = 2**62 - 1  # the largest first seed of a rollout (miles.state.seeds)
    batch = [GenerateRequest([1, 5, 6, 7], sampled, seed=seed), GenerateRequest([1, 8], greedy, seed=seed + 1)]
    engine.generate(batch)
    engine.sequence_logprobs([1, 5, 6, 7, 2])
    engine.update_weights_from_disk(str(tmp_path), 1)
    payloads = [serialize_bucket(bucket)[0] for bucket in TENSOR_BUCKETS]
    engine.update_weights_from_tensor(payloads[:1], 2, last=False)  # a push in parts, as the controller sends it
    engine.update_weights_from_tensor(payloads[1:], 2)
    group = WeightGroup("127.0.0.1", 29500, 3, "miles-weights-1", "nccl", 600.0)
    buckets = [[("model.embed_tokens.weight", "bfloat16", [16, 64])], [("model.norm.weight", "bfloat16", [64])]]
    engine.update_weights_from_distributed(group, 1, buckets, 3, load_format=FLATTENED)
    engine.update_weights_from_distributed(replace(group, group_name="miles-weights-2"), 1, buckets, 4)
    engine.pause_generation_mode = "in_place"
    engine.update_weights_from_disk(str(tmp_path), 5)
    engine.weights_checksum()
    engine.release_memory(["kv_cache", "weights"])
    engine.resume_memory(["weights"])
    engine.resume_memory(["kv_cache"])
    lora = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)}
    peft = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    engine.load_adapter("math", lora, peft, 1)
    engine.load_adapter("math", lora, peft, 2)  # a new version: unloaded, then loaded
    engine.generate([replace(batch[0], adapter="math"), batch[1]])
    engine.unload_adapter("math")
    engine._http.close()
    return sent


@pytest.fixture(scope="module")
def rules(model_dirs, tmp_path_factory) -> dict:
    """SGLang's verdicts on every launch command and request body, from one run of its Python."""
    if not REAL_PYTHON:
        pytest.skip(
            "SGLang's rules need its Python in MILES_SGLANG_PYTHON (make install-sglang-cpu; make test sets it)"
        )
    if not Path(REAL_PYTHON).is_file():
        pytest.fail(f"MILES_SGLANG_PYTHON={REAL_PYTHON} does not exist: run make install-sglang-cpu")
    launches = _launch_commands(model_dirs)
    probes = _probes(launches)
    bodies = _request_bodies(tmp_path_factory.mktemp("engine"))
    argvs = [_argv(command) for command, _ in launches.values()] + list(probes.values())
    task = {"launches": argvs, "requests": bodies, "vocab_size": TINY_VOCAB}
    done = subprocess.run(
        [REAL_PYTHON, str(RULES)], input=json.dumps(task), capture_output=True, text=True, timeout=300, check=False
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"{RULES.name} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    verdicts = json.loads(lines[-1])
    names = [*launches, *probes]
    return {
        "commands": launches,
        "launches": dict(zip(names, verdicts["launches"], strict=True)),
        "bodies": bodies,
        "requests": verdicts["requests"],
    }


def _resolved(rules, name: str) -> dict:
    verdict = rules["launches"][name]
    assert verdict["ok"], f"SGLang refuses the {name} launch command {verdict['argv']}: {verdict['error']}"
    resolved, argv = verdict["resolved"], verdict["argv"]
    assert resolved["host"] == "127.0.0.1" and resolved["port"] == int(argv[argv.index("--port") + 1])
    assert resolved["enable_metrics"] is True  # /metrics: its counters are the engine's progress
    return resolved


@pytest.mark.parametrize("preset", PRESETS)
def test_the_presets_launch_commands_pass_sglangs_checks_on_an_h100(rules, preset):
    """Pins: a preset's bfloat16 server on an H100 gets FlashAttention 3 from SGLang (no --attention-backend is sent)
    with deterministic inference on, the memory share the preset sets or else SGLang's own, no CPU-only flag."""
    resolved = _resolved(rules, preset)
    rollout = load_config(ROOT / "deployments" / "configs" / preset).rollout
    assert "--attention-backend" not in rules["commands"][preset][0]
    assert resolved["device"] == "cuda" and resolved["dtype"] == "bfloat16"
    assert resolved["attention_backend"] == "fa3" and resolved["enable_deterministic_inference"] is True
    assert resolved["tp_size"] == rollout.sglang.tp_size
    assert resolved["weight_version"] == "0" and resolved["sleep_on_idle"] is False
    assert resolved["max_total_tokens"] is None  # sized by SGLang from its memory share
    if rollout.sglang.mem_fraction_static is not None:
        assert resolved["mem_fraction_static"] == rollout.sglang.mem_fraction_static
    else:
        assert 0 < resolved["mem_fraction_static"] < 1


def test_the_cpu_contract_servers_launch_command_passes_sglangs_checks(rules):
    """Pins: the CPU server runs torch_native attention without deterministic inference, sleeps while idle, and
    holds CPU_KV_CACHE_TOKENS of KV cache; SGLangEngine starts it with SGLang's CPU engine chosen."""
    resolved = _resolved(rules, "cpu-contract")
    assert rules["commands"]["cpu-contract"][1]["SGLANG_USE_CPU_ENGINE"] == "1"
    assert resolved["device"] == "cpu" and resolved["dtype"] == "float32" and resolved["tp_size"] == 1
    assert resolved["attention_backend"] == "torch_native" and resolved["enable_deterministic_inference"] is False
    assert resolved["sleep_on_idle"] is True and resolved["max_total_tokens"] == CPU_KV_CACHE_TOKENS
    assert resolved["weight_version"] == "3" and 0 < resolved["mem_fraction_static"] < 1


def test_a_float32_gpu_launch_gets_triton_and_deterministic_inference(rules):
    """Pins: triton takes deterministic inference on an H100, for a float32 server started without SGLang's CPU
    engine."""
    resolved = _resolved(rules, "float32-gpu")
    assert "SGLANG_USE_CPU_ENGINE" not in (rules["commands"]["float32-gpu"][1] or {})
    assert resolved["device"] == "cuda" and resolved["dtype"] == "float32" and resolved["tp_size"] == 1
    assert resolved["weight_version"] == "2" and resolved["sleep_on_idle"] is False
    assert resolved["attention_backend"] == "triton" and resolved["enable_deterministic_inference"] is True


def test_a_colocated_launch_keeps_its_memory_share(rules):
    """Pins: --mem-fraction-static as sent, the share of the GPU a server beside the trainer takes."""
    resolved = _resolved(rules, "colocated")
    assert resolved["mem_fraction_static"] == 0.5 and resolved["dtype"] == "bfloat16" and resolved["tp_size"] == 1
    assert resolved["attention_backend"] == "fa3" and resolved["enable_deterministic_inference"] is True


def test_a_colocated_launch_without_a_share_gets_what_its_trainer_leaves_and_the_memory_saver(rules):
    """Pins: --enable-memory-saver (release and resume give memory back only with it) and --mem-fraction-static as
    derived: 90% of the H100 less the 16 GiB its trainer rank keeps between steps."""
    resolved = _resolved(rules, "colocated-derived")
    assert resolved["enable_memory_saver"] is True
    assert resolved["mem_fraction_static"] == colocated_engine_share(16 * 2**30, H100_MEMORY_MIB * 2**20) == 0.699


def test_a_lora_launch_on_two_gpus_sizes_its_adapter_pool(rules):
    """Pins: --enable-lora with the adapters' largest rank and every module they target, --max-loras-per-batch,
    --max-running-requests and --tp-size as sent."""
    resolved = _resolved(rules, "lora-tp2")
    assert resolved["tp_size"] == 2 and resolved["max_running_requests"] == 64
    assert resolved["enable_lora"] is True and resolved["max_lora_rank"] == 16
    assert resolved["max_loras_per_batch"] == SGLangConfig().max_loras_per_batch
    assert sorted(resolved["lora_target_modules"]) == sorted(AdapterConfig(name="math").target_modules)


def test_sglang_still_makes_the_choices_the_engines_flags_work_around(rules):
    """Pins the reasons for two of the engine's choices: SGLang refuses deterministic inference with torch_native
    (so a CPU server goes without it), and picks fa3 for a deterministic float32 server on an H100 when left to
    choose (so a float32 GPU server names triton)."""
    refused = rules["launches"]["cpu-deterministic"]
    assert not refused["ok"] and "deterministic inference" in refused["error"] and "torch_native" in refused["error"]
    chosen = rules["launches"]["float32-sglang-choice"]
    assert chosen["ok"], chosen["error"]
    assert chosen["resolved"]["attention_backend"] == "fa3" and chosen["resolved"]["dtype"] == "float32"


def test_sglang_reads_each_tensor_of_a_flattened_bucket_as_it_was_sent(rules):
    """Pins: SGLang's scheduler and model runner rebuild every tensor of the engine's flattened buckets with its
    dtype, shape and values, a bucket of mixed dtypes and odd sizes included (each byte range aligned for its view)."""
    read = [v["tensors"] for v in rules["requests"] if v["endpoint"] == "/update_weights_from_tensor"]
    sent = [
        {name: [str(t.dtype), list(t.shape), float(t.double().sum())] for name, t in bucket.items()}
        for bucket in TENSOR_BUCKETS
    ]
    assert read == sent


def test_every_request_body_the_engine_sends_is_one_sglang_takes(rules):
    """Pins: each body SGLangEngine POSTs parses into the request class of SGLang's route with no field it lacks
    (the server would ignore it), and a /generate body passes its contract gate, normalization and sampling checks."""
    assert {path for path, _ in rules["bodies"]} == ENDPOINTS
    refused = [
        f"{verdict['endpoint']} {json.dumps(body)[:300]}: {verdict['error']}"
        for (_, body), verdict in zip(rules["bodies"], rules["requests"], strict=True)
        if not verdict["ok"]
    ]
    assert not refused, "SGLang refuses bodies the engine sends:\n" + "\n".join(refused)
    classes = {verdict["endpoint"]: verdict["request_class"] for verdict in rules["requests"]}
    assert classes["/generate"] == "GenerateReqInput" and classes["/weights_checker"] == "CheckWeightsReqInput"
