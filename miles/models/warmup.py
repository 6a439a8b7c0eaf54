"""Supervised warm-up on the built-in task: answer tokens and EOS only, stop at a greedy-accuracy target."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence

import torch

from miles.config import WarmupConfig
from miles.envs import task_rows
from miles.envs.arithmetic import SUMS
from miles.envs.calculator import demonstration
from miles.observe.progress import ProgressLine

log = logging.getLogger(__name__)

IGNORE = -100
TOOL_SHARE = 0.5  # of the sums task's warm-up sequences that call the calculator; RL learns which pays


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


def _turns(task: str, row: dict[str, str], draw: random.Random) -> list[tuple[str, bool]]:
    """What follows the prompt in a warm-up sequence, as (text, the model's) turns: the answer; for the sums task,
    a share TOOL_SHARE of them a worked calculator episode instead."""
    if task == SUMS:
        return demonstration(row, use_tool=draw.random() < TOOL_SHARE)
    return [(row["label"], True)]


def _sft_tensors(tokenizer, rows, turns: list[list[tuple[str, bool]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt, then each turn; a model turn is trained on and ends with EOS, an environment turn is context only."""
    prompts = tokenizer([r["prompt"] for r in rows])["input_ids"]
    sequences, trained = [], []
    for prompt, row_turns in zip(prompts, turns, strict=True):
        seq, mask = list(prompt), [False] * len(prompt)
        for text, by_model in row_turns:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + (
                [tokenizer.eos_token_id] if by_model else []
            )
            seq, mask = seq + ids, mask + [by_model] * len(ids)
        sequences.append(seq)
        trained.append(mask)
    width = max(len(seq) for seq in sequences)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (seq, mask) in enumerate(zip(sequences, trained, strict=True)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq)] = torch.where(torch.tensor(mask), torch.tensor(seq), IGNORE)
    return input_ids, labels


def warm_up(model, tokenizer, tasks: Sequence[str], config: WarmupConfig, seed: int) -> dict:
    """SFT on the union of the tasks' rows; the held-out set has an equal share of each task."""
    draw = random.Random(seed)
    tasks_rows = [(task, row) for task in tasks for row in task_rows(task)]
    rows = [row for _, row in tasks_rows]
    input_ids, labels = _sft_tensors(tokenizer, rows, [_turns(task, row, draw) for task, row in tasks_rows])
    attention = (input_ids != tokenizer.pad_token_id).long()
    share = -(-config.eval_prompts // len(tasks))
    held_out = [row for task in tasks for row in eval_rows(task, share, seed + 1)]
    task_names = " + ".join(tasks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    accuracy, step = greedy_accuracy(model, tokenizer, held_out), 0
    bar = ProgressLine("warm-up", config.max_steps)
    bar.note(
        f"warm-up SFT of the embedded model on {task_names} until greedy accuracy {config.target_accuracy} (cached after)"
    )
    model.train()
    while accuracy < config.target_accuracy and step < config.max_steps:
        idx = torch.randint(len(rows), (config.batch_size,), generator=generator)
        loss = model(input_ids=input_ids[idx], attention_mask=attention[idx], labels=labels[idx]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if step % config.eval_every == 0:
            accuracy = greedy_accuracy(model, tokenizer, held_out)
            status = f"step {step}: loss {loss.item():.3f}, greedy accuracy {accuracy:.3f}"
            log.info("warm-up %s", status)
            bar.update(step, status)
    bar.close()
    bar.note(f"warm-up done: {step} steps, greedy accuracy {accuracy:.3f}")
    model.eval()
    return {"steps": step, "greedy_accuracy": accuracy, "seconds": round(time.perf_counter() - started, 1)}
