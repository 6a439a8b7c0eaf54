"""The CUDA path of the engine and the trainers, in one process (no Ray, no Prefect): correctness and throughput.

1. TorchEngine and TrainActor on CUDA, fp32: the trainer's log-probs of the engine's samples match the
   engine's; three GRPO rollouts, each pushed to the engine, keep them matched.
2. Multi-LoRA on CUDA: a LoRATrainActor steps two adapters; one engine serves both in one mixed batch, and
   each adapter's rows match the trainer's log-probs.
3. Throughput of a larger random Llama: engine tokens/s (batch x new tokens, no stop) and trainer tokens/s.
4. The tensor transport's payload (miles.weights.payload): CUDA tensors sent as IPC handles are opened by another
   process, as an SGLang server on the same GPU opens them, and hold the sender's values.
5. A model of a pretrained model's size (Qwen2.5-0.5B's shape and vocabulary, random weights stored in bf16): the
   TorchEngine serving it in bf16, the trainer as one FSDP2 rank computing in bf16 (token-budget micro-batches,
   log-probs in chunks, activation checkpointing), the trainer-vs-engine log-prob gap, engine and trainer tokens/s,
   and the fraction of the measured bf16 matmul peak the trainer reaches (6 x parameters x tokens per step, plus
   attention).

It needs no Ray and no Prefect (scripts/gpu_check.sh installs the few wheels the GPU machine lacks); `--dry-run`
runs every check on the CPU at small sizes, to show that it starts with that machine's torch and transformers.
Prints one line per check; exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import ast
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch

from miles.config import AdapterConfig, DataConfig, ModelConfig, TinyModelConfig, load_config
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.tiny import build_tiny_model, build_tokenizer
from miles.rewards import resolve_reward
from miles.rollout.schema import SampleRecord, records_table
from miles.train.actor import TrainActor
from miles.train.algorithms.advantages import grpo
from miles.train.batch import batch_from_table
from miles.train.lora import LoRATrainActor
from miles.train.update import batch_logprobs

DEVICE = "cuda"
# Qwen2.5-0.5B's shape (494M parameters with its 151,936-token vocabulary and tied embeddings).
QWEN2_5_0_5B_SHAPE = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
)


def _synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _model_dir(root: Path, name: str, shape: TinyModelConfig) -> Path:
    tokenizer = build_tokenizer()
    model = build_tiny_model(ModelConfig(tiny=shape), len(tokenizer), seed=0)
    model.save_pretrained(root / name)
    tokenizer.save_pretrained(root / name)
    return root / name


def _requests(tokenizer, count: int, group: int, max_new: int, stop: bool, adapter: str | None = None, seed: int = 0):
    sampling = SamplingParams(max_new_tokens=max_new, stop_token_ids=(tokenizer.eos_token_id,) if stop else ())
    prompts = [f"{a}+{(7 * a) % 100}=" for a in range(count // group)]
    ids = tokenizer(prompts)["input_ids"]
    return prompts, [
        GenerateRequest(prompt_ids=p, sampling=sampling, adapter=adapter, seed=seed + i * group + j)
        for i, p in enumerate(ids)
        for j in range(group)
    ]


def _table(requests, results, rewards, group: int) -> pa.Table:
    n = len(results)
    lengths = torch.tensor([len(r.output_ids) for r in results], dtype=torch.float64)
    advantages = grpo(torch.tensor(rewards, dtype=torch.float64), torch.arange(n) // group, lengths).tolist()
    records = [
        SampleRecord.completion(None, q.prompt_ids, r, reward, r.finish_reason == "stop")
        for q, r, reward in zip(requests, results, rewards, strict=True)
    ]
    return records_table(
        records,
        rollout_id=0,
        first_index=0,
        group_index=[i // group for i in range(n)],
        adapter=[q.adapter for q in requests],
        label=[""] * n,
        advantage=advantages,
    )


def _logprob_gap(model, table: pa.Table, config) -> float:
    batch = batch_from_table(table, 0)
    mask = batch.response_mask
    trainer = batch_logprobs(model, batch, config, torch.device(DEVICE)).cpu()
    return float((trainer[mask] - batch.rollout_logprobs[mask]).abs().max())


def check_full_model(root: Path, tokenizer) -> bool:
    model_dir = _model_dir(root, "tiny", TinyModelConfig())
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            "rollout.rollout_batch_size=32",
            "train.global_batch_size=64",
            "train.micro_batch_size=64",
            f"train.device={DEVICE}",
        ],
        run_dir=str(root / "run"),
    )
    engine = TorchEngine(str(model_dir), device=DEVICE)
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    trainer = TrainActor(config, str(model_dir))
    reward = resolve_reward("digit_match", config)
    ok = True
    for rollout_id in range(3):
        prompts, requests = _requests(tokenizer, 256, 8, 4, stop=True, seed=1000 * rollout_id)
        results = engine.generate(requests)
        texts = tokenizer.batch_decode([r.output_ids for r in results], skip_special_tokens=True)
        labels = [str(sum(map(int, p[:-1].split("+")))) for p in prompts for _ in range(8)]
        rewards = [float(reward(t, l, True)) for t, l in zip(texts, labels, strict=True)]
        table = _table(requests, results, rewards, 8)
        gap = _logprob_gap(trainer.model, table, config)
        metrics = trainer.train(rollout_id, table)
        engine.update_weights(trainer.weights(), rollout_id + 1)
        ok &= gap < 1e-4
        print(
            f"full model, rollout {rollout_id}: reward {sum(rewards) / len(rewards):.3f}, engine-vs-trainer "
            f"log-prob max gap {gap:.2e}, loss {metrics['loss']:.4f}, {metrics['optimizer_steps']} steps"
        )
    return ok


def check_multi_lora(root: Path, tokenizer) -> bool:
    model_dir = root / "tiny"
    config = load_config(None, [f"model.path={model_dir}", f"train.device={DEVICE}"], run_dir=str(root / "lora"))
    trainer = LoRATrainActor(config, str(model_dir))
    engine = TorchEngine(str(model_dir), device=DEVICE)
    ok = True
    adapters = [
        AdapterConfig(name=n, data=DataConfig(task="addition"), rollout_batch_size=8) for n in ("add-a", "add-b")
    ]
    for adapter in adapters:
        trainer.add_adapter(adapter, config.adapter_view(adapter))
        _, requests = _requests(tokenizer, 64, 8, 4, stop=True)
        results = engine.generate(requests)
        rewards = [float(len(r.output_ids) == 3) for r in results]  # any signal: trains the adapter off its init
        trainer.train(adapter.name, 0, _table(requests, results, rewards, 8))
        engine.load_adapter(
            adapter.name, trainer.adapter_weights(adapter.name), trainer.adapter_config(adapter.name), 1
        )
    mixed = []
    for i, adapter in enumerate(adapters):
        mixed += _requests(tokenizer, 32, 4, 4, stop=True, adapter=adapter.name, seed=100 * i)[1]
    results = engine.generate(mixed)
    for i, adapter in enumerate(adapters):
        rows = slice(32 * i, 32 * (i + 1))
        trainer.model.set_adapter(adapter.name)
        trainer.model.eval()
        gap = _logprob_gap(trainer.model, _table(mixed[rows], results[rows], [0.0] * 32, 4), config)
        ok &= gap < 1e-4 and {r.weight_version for r in results[rows]} == {1}
        print(f"multi-LoRA, adapter {adapter.name} in a mixed batch: engine-vs-peft log-prob max gap {gap:.2e}")
    return ok


def check_throughput(root: Path, tokenizer, hidden: int, layers: int, batch: int, new_tokens: int) -> None:
    shape = TinyModelConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=hidden // 64,
        intermediate_size=hidden * 4,
        max_position_embeddings=64 + new_tokens,
    )
    model_dir = _model_dir(root, "large", shape)
    engine = TorchEngine(str(model_dir), device=DEVICE)
    _, requests = _requests(tokenizer, batch, 8, new_tokens, stop=False)
    engine.generate(requests[:8])
    _synchronize()
    started = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.output_ids) for r in results)
    params = sum(p.numel() for p in engine.model.parameters())
    print(
        f"engine throughput: {params / 1e6:.0f}M-parameter Llama, fp32, batch {batch} x {new_tokens} new tokens: "
        f"{tokens / seconds:,.0f} tokens/s ({seconds:.2f} s)"
    )
    del engine
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            f"train.global_batch_size={batch}",
            f"train.micro_batch_size={min(batch, 128)}",
            f"rollout.rollout_batch_size={batch // 8}",
            f"train.device={DEVICE}",
        ],
        run_dir=str(root / "large-run"),
    )
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    trainer = TrainActor(config, str(model_dir))
    table = _table(requests, results, [float(i % 3) for i in range(batch)], 8)
    trainer.train(0, table)  # warm-up
    _synchronize()
    started = time.perf_counter()
    trainer.train(1, table)
    _synchronize()
    seconds = time.perf_counter() - started
    trained = sum(len(q.prompt_ids) + len(r.output_ids) for q, r in zip(requests, results, strict=True))
    print(
        f"trainer throughput: same model, {batch} samples, micro-batch 128: {trained / seconds:,.0f} tokens/s ({seconds:.2f} s per step)"
    )


def _bf16_peak_tflops() -> float:
    """The bf16 matmul rate this device reaches on a large square product (what the trainer's fraction is of)."""
    size = 8192 if DEVICE == "cuda" else 512
    a = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    a @ a
    _synchronize()
    started = time.perf_counter()
    for _ in range(10):
        a @ a
    _synchronize()
    return 10 * 2 * size**3 / (time.perf_counter() - started) / 1e12


def check_real_size(root: Path, tokenizer, shape: dict, batch: int, new_tokens: int) -> bool:
    """A model of a pretrained model's size and vocabulary (random weights, stored in bf16): the TorchEngine serving
    it in bf16 (rollout.dtype), the trainer as one FSDP2 rank computing in bf16 with its fp32 master weights, the
    trainer-vs-engine log-prob gap, throughput and the fraction of the bf16 peak the trainer's matmuls reach."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    model_dir = root / "real-size"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model
    engine = TorchEngine(str(model_dir), device=DEVICE, dtype="bfloat16")
    _, requests = _requests(tokenizer, batch, 8, new_tokens, stop=False)
    engine.generate(requests[:8])
    _synchronize()
    started = time.perf_counter()
    results = engine.generate(requests)
    _synchronize()
    seconds = time.perf_counter() - started
    print(
        f"real size: {parameters / 1e6:.0f}M-parameter Llama, vocab {shape['vocab_size']}, bf16 engine, batch {batch} x "
        f"{new_tokens} new tokens: {sum(len(r.output_ids) for r in results) / seconds:,.0f} tokens/s ({seconds:.2f} s)"
    )
    del engine
    run_config = load_config(
        None,
        [
            f"model.path={model_dir}",
            f"rollout.rollout_batch_size={batch // 8}",
            f"train.global_batch_size={batch}",
            f"train.device={DEVICE}",
            "train.sharding=fsdp",
            "train.param_dtype=bfloat16",
            "train.gradient_checkpointing=true",
            "train.max_tokens_per_micro_batch=16384",
        ],
        run_dir=str(root / "real-size-run"),
    )
    Path(run_config.run_dir).mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        rendezvous = f"127.0.0.1:{probe.getsockname()[1]}"
    trainer = TrainActor(run_config, str(model_dir), rank=0, world_size=1, rendezvous=rendezvous)
    table = _table(requests, results, [float(i % 3) for i in range(batch)], 8)
    batch_tensors = batch_from_table(table, 0)
    mask = batch_tensors.response_mask
    gap = (
        batch_logprobs(trainer.model, batch_tensors, run_config, torch.device(DEVICE)).cpu()
        - batch_tensors.rollout_logprobs
    )[mask].abs()
    trainer.train(0, table)  # warm-up: AdamW's state
    _synchronize()
    started = time.perf_counter()
    metrics = trainer.train(1, table)
    _synchronize()
    seconds = time.perf_counter() - started
    lengths = batch_tensors.attention_mask.sum(1)
    tokens = int(lengths.sum())
    # Forward and backward: 6 x parameters per token, plus attention's two matmuls per layer over each sequence
    # (12 x layers x hidden x length^2); activation checkpointing's recompute not counted.
    attention = 12 * shape["num_hidden_layers"] * shape["hidden_size"] * int((lengths**2).sum())
    achieved = (6 * parameters * tokens + attention) / seconds / 1e12
    peak = _bf16_peak_tflops()
    ok = bool(torch.isfinite(torch.tensor(metrics["loss"])) and gap.mean() < 0.05)
    print(
        f"real size: one FSDP2 rank in bf16, engine-vs-trainer log-prob gap mean {gap.mean():.2e} max {gap.max():.2e}; "
        f"loss {metrics['loss']:.4f}; {tokens / seconds:,.0f} trainer tokens/s ({seconds:.2f} s per step); "
        f"{achieved:.1f} TFLOP/s = {achieved / peak:.1%} of the measured bf16 peak {peak:.0f} TFLOP/s"
    )
    trainer.model = None
    torch.distributed.destroy_process_group()
    return ok


# The receiving side, as SGLang's server does it: the device arrives as a UUID, mapped back to this process's index.
_OPEN_PAYLOAD = """
import base64, pickle, sys, torch
from torch.multiprocessing import reductions
rebuild = reductions.rebuild_cuda_tensor
def by_uuid(*args):
    index = next(i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == args[6])
    return rebuild(*args[:6], index, *args[7:])
reductions.rebuild_cuda_tensor = by_uuid
bucket = pickle.loads(base64.b64decode(sys.stdin.read()))
flat = bucket["flattened_tensor"]
tensors = {r.name: flat[r.start_idx : r.end_idx].view(r.dtype).reshape(r.shape) for r in bucket["metadata"]}
print(repr({name: float(t.double().sum()) for name, t in tensors.items()}))
"""


def check_tensor_payload() -> bool:
    from miles.weights.payload import serialize_bucket

    torch.manual_seed(0)
    # Mixed dtypes, an odd size between them: each byte range must stay aligned for its dtype.
    tensors = {
        "a": torch.randn(256, 64, device=DEVICE),
        "b": torch.randn(7, device=DEVICE).bfloat16(),
        "c": torch.randn(3, 5, device=DEVICE),
    }
    started = time.perf_counter()
    payload, bucket = serialize_bucket(tensors)
    opened = subprocess.run(
        [sys.executable, "-c", _OPEN_PAYLOAD], input=payload, capture_output=True, text=True, timeout=120
    )
    if opened.returncode != 0:
        print(f"tensor payload: FAILED, the other process could not open the bucket: {opened.stderr[-1500:]}")
        return False
    expected = {name: float(t.double().sum()) for name, t in tensors.items()}
    ok = ast.literal_eval(opened.stdout.strip()) == expected
    print(
        f"tensor payload: {'ok' if ok else 'FAILED'}, {len(payload):,} base64 characters for "
        f"{sum(t.numel() * t.element_size() for t in tensors.values()):,} bytes of tensors, opened in another process "
        f"in {time.perf_counter() - started:.2f} s"
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="every check on the CPU at small sizes: the script starts, imports and runs up to the first CUDA call",
    )
    args = parser.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.dry_run else "cuda"
    real_shape = dict(QWEN2_5_0_5B_SHAPE)
    if args.dry_run:
        args.hidden, args.layers, args.batch, args.new_tokens = 128, 2, 16, 8
        real_shape.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}")
    tokenizer = build_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ok = check_full_model(root, tokenizer)
        ok &= check_multi_lora(root, tokenizer)
        if DEVICE == "cuda":  # CUDA IPC handles exist on a GPU only
            ok &= check_tensor_payload()
        check_throughput(root, tokenizer, args.hidden, args.layers, args.batch, args.new_tokens)
        ok &= check_real_size(root, tokenizer, real_shape, min(args.batch, 64), 128 if DEVICE == "cuda" else 8)
    print("gpu check: " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
