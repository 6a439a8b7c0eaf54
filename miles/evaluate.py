"""Greedy evaluation with plain transformers, independent of the engine under test."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from miles.envs import task_rows


def eval_rows(task: str, n: int, seed: int) -> list[dict[str, str]]:
    return random.Random(seed).sample(task_rows(task), n)


@torch.inference_mode()
def greedy_accuracy(
    model, tokenizer, rows: list[dict[str, str]], max_new_tokens: int = 4, batch_size: int = 256
) -> float:
    """Share of rows whose greedy answer equals the label and ends with EOS."""
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        enc = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        new_tokens = out[:, enc["input_ids"].shape[1] :].tolist()
        for row, tokens in zip(chunk, new_tokens, strict=True):
            if tokenizer.eos_token_id not in tokens:
                continue
            answer = tokenizer.decode(tokens[: tokens.index(tokenizer.eos_token_id)], skip_special_tokens=True)
            correct += answer == row["label"]
    model.train(was_training)
    return correct / len(rows)


def evaluate_checkpoint(
    model_dir: str | Path, task: str, n: int = 200, seed: int = 1234, adapter_dir: str | Path | None = None
) -> float:
    """Greedy accuracy of a Hugging Face model directory (with a PEFT adapter directory on top, if given) on `n`
    random prompts of the task."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return greedy_accuracy(model, tokenizer, eval_rows(task, n, seed))
