"""Samples for engine, trainer and store tests: requests, seeds, and rollout tables built from them or by hand."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import torch

from miles.engines.base import GenerateRequest, SamplingParams
from miles.rollout.generation import SampleRecord
from miles.rollout.schema import ROLLOUT_SCHEMA, records_table
from miles.train.algorithms.advantages import grpo


def make_requests(tokenizer, prompts, **sampling):
    params = SamplingParams(stop_token_ids=(tokenizer.eos_token_id,), **{"max_new_tokens": 4, **sampling})
    return [GenerateRequest(prompt_ids=tokenizer(p)["input_ids"], sampling=params) for p in prompts]


def seeded(requests, seed):
    """The requests with seeds seed * 10_000 + i, as a rollout gives them."""
    return [dataclasses.replace(r, seed=seed * 10_000 + i) for i, r in enumerate(requests)]


def completions_table(requests, results, rewards, group_index, advantages) -> pa.Table:
    """Rollout 0 of one completion per request, stored as single_turn stores them (for the engine and trainer tests,
    and the benchmarks, which drive the engines without a RolloutExecutor)."""
    records = [
        SampleRecord.completion(None, q.prompt_ids, r, reward, r.finish_reason == "stop")
        for q, r, reward in zip(requests, results, rewards, strict=True)
    ]
    adapters, labels = [q.adapter for q in requests], [""] * len(records)
    return records_table(
        records,
        rollout_id=0,
        first_index=0,
        group_index=group_index,
        adapter=adapters,
        label=labels,
        advantage=advantages,
    )


def grpo_advantages(rewards: torch.Tensor, results, group_size: int = 4) -> list[float]:
    """GRPO advantages of `rewards` over groups of `group_size` consecutive samples."""
    lengths = torch.tensor([len(r.output_ids) for r in results], dtype=torch.float64)
    return grpo(rewards, torch.arange(len(results)) // group_size, lengths).tolist()


def training_table(requests, results, advantages=None) -> pa.Table:
    n = len(results)
    return completions_table(requests, results, [0.0] * n, range(n), advantages or [0.0] * n)


def rollout_table(n: int = 3, rollout_id: int = 5) -> pa.Table:
    columns = {
        "rollout_id": [rollout_id] * n,
        "sample_index": list(range(n)),
        "group_index": [i // 2 for i in range(n)],
        "adapter": ["default"] * n,
        "prompt_ids": [[1] + [3 + i] * (i + 1) for i in range(n)],
        "response_ids": [[4] * (n - i) + [2] for i in range(n)],
        "response_length": [n - i + 1 for i in range(n)],
        "rollout_logprobs": [[-0.5] * (n - i + 1) for i in range(n)],
        "loss_mask": [[1] * (n - i + 1) for i in range(n)],
        "raw_reward": [float(i % 2) for i in range(n)],
        "advantage": [0.25 * i for i in range(n)],
        "status": [("completed", "truncated")[i % 2] for i in range(n)],
        "weight_version": [rollout_id] * n,
        "label": [str(i) for i in range(n)],
        "prompt": [f"prompt {i}" for i in range(n)],
        "num_turns": [1] * n,
        "end_reason": [("done", "max_new_tokens")[i % 2] for i in range(n)],
        "weight_versions": [[rollout_id] * (n - i + 1) for i in range(n)],
        "token_rewards": [None] * n,
        "baseline_reward": [None] * n,
    }
    return pa.table(columns, schema=ROLLOUT_SCHEMA)


ADAPTER_PROMPTS = ["1+2=", "45+67=", "9+99=", "3+", "10+0=", "88+8="]


def with_adapter(requests, adapter):
    return [dataclasses.replace(r, adapter=adapter) for r in requests]
