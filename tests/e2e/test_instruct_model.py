"""A model like a pretrained instruct model (32k BPE vocabulary, ChatML, bf16 weights, <|im_end|> in its
generation_config.json) through the engine, the trainer and the sync and async flows, with chat data and the gsm8k
reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from flows.async_rl import async_rl
from flows.sync_rl import sync_rl
from miles.config import load_config
from miles.engines.base import GenerateRequest, SamplingParams, eos_token_ids
from miles.engines.torch_engine import TorchEngine
from miles.rollout.store import RolloutStore
from miles.state.run_dir import RunDir
from miles.train.logprobs import token_logprobs
from tests.helpers.instruct_model import chat_data_overrides, questions, write_gsm8k_data


def _chat_requests(tokenizer, count: int) -> list[GenerateRequest]:
    sampling = SamplingParams(max_new_tokens=16, stop_token_ids=eos_token_ids(tokenizer))
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q, _ in questions(count, seed=5)
    ]
    return [
        GenerateRequest(prompt_ids=tokenizer(p)["input_ids"], sampling=sampling, seed=i) for i, p in enumerate(prompts)
    ]


def _gaps_to_a_forward(model_dir, requests, results) -> list[float]:
    """|engine log-prob - a Hugging Face fp32 forward's| of every generated token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gaps = []
    for request, result in zip(requests, results, strict=True):
        ids = torch.tensor([request.prompt_ids + result.output_ids])
        with torch.no_grad():
            expected = token_logprobs(model(input_ids=ids).logits, ids)[0, len(request.prompt_ids) :]
        gaps += (expected - torch.tensor(result.logprobs)).abs().tolist()
    return gaps


def test_both_end_of_sequence_ids_stop_generation_and_the_engine_agrees_with_a_forward(instruct_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(instruct_model_dir)
    im_end, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert set(eos_token_ids(tokenizer)) == {im_end, end_of_text}
    assert tokenizer.eos_token_id == end_of_text  # <|im_end|> comes from generation_config.json alone
    requests = _chat_requests(tokenizer, 12)
    results = TorchEngine(str(instruct_model_dir), num_threads=1).generate(requests)
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert stopped and all(r.output_ids[-1] == im_end for r in stopped)
    assert all(im_end not in r.output_ids for r in results if r.finish_reason == "length")

    assert max(_gaps_to_a_forward(instruct_model_dir, requests, results)) <= 1e-5


def test_a_bf16_engine_is_within_rounding_of_the_fp32_trainer(instruct_model_dir):
    """rollout.dtype=bfloat16: the engine serves the model's own dtype; its log-probs differ from the fp32 forward by
    bf16 rounding (printed: the gap a GPU run sees between a bf16 engine and the fp32 trainer)."""
    tokenizer = AutoTokenizer.from_pretrained(instruct_model_dir)
    requests = _chat_requests(tokenizer, 8)
    results = TorchEngine(str(instruct_model_dir), dtype="bfloat16", num_threads=1).generate(requests)
    gaps = _gaps_to_a_forward(instruct_model_dir, requests, results)
    mean = sum(gaps) / len(gaps)
    print(f"bf16 engine vs fp32 forward: mean |log-prob gap| {mean:.4f}, max {max(gaps):.4f} over {len(gaps)} tokens")
    assert 1e-5 < mean < 0.1


@pytest.mark.parametrize("flow", [sync_rl, async_rl], ids=["sync", "async"])
def test_flows_train_a_bf16_chat_model_and_keep_its_dtype(ray_session, prefect_api, instruct_model_dir, tmp_path, flow):
    data = write_gsm8k_data(tmp_path / "gsm8k.jsonl", 32)
    config = load_config(
        None,
        [
            *chat_data_overrides(instruct_model_dir, data),
            "rollout.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=16",
            "rollout.num_threads=1",
            "train.global_batch_size=16",
            "train.num_threads=1",
            "train.lr=1e-4",
        ],
        run_dir=str(tmp_path / "run"),
        num_rollout=2,
        save_interval=2,
    )
    assert config.train.max_tokens_per_micro_batch == 8192 and config.train.gradient_checkpointing  # own-data preset
    state = flow(config, return_state=True)
    assert state.is_completed(), state.message

    run_dir = RunDir(config.run_dir)
    model_dir = run_dir.checkpoint(1) / "model"
    stored = {k: v for f in model_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    assert {t.dtype for t in stored.values()} == {torch.bfloat16} and "lm_head.weight" not in stored
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == list(
        json.loads((Path(instruct_model_dir) / "generation_config.json").read_text())["eos_token_id"]
    )

    records = [json.loads(line) for line in (run_dir.path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train_rollout_logprob_abs_diff" in r]
    assert len(trained) == 2 and all(r["train_rollout_logprob_abs_diff"] <= 1e-5 for r in trained)
    tokenizer = AutoTokenizer.from_pretrained(instruct_model_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    table = RolloutStore(run_dir.rollouts).read(0)
    prompts = table.column("prompt").to_pylist()
    assert all(p.startswith("<|im_start|>user\n") and p.endswith("<|im_start|>assistant\n") for p in prompts)
    responses = zip(table.column("response_ids").to_pylist(), table.column("status").to_pylist(), strict=True)
    ends = [ids[-1] for ids, status in responses if status == "completed"]
    assert ends and set(ends) == {im_end}
