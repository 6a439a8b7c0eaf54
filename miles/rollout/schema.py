"""The rollout table: one row per sample, the handover format between rollout and trainer.

A sample whose reward could not be computed has status "failed" and a null raw_reward; it stays in the
stored rollout and is never trained on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from miles.engines.base import GenerateRequest, GenerateResult

SCHEMA_VERSION = "3"
STATUSES = ("completed", "truncated", "aborted", "failed")

ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("rollout_id", pa.int64(), nullable=False),
        pa.field("sample_index", pa.int64(), nullable=False),
        pa.field("group_index", pa.int64(), nullable=False),
        pa.field("adapter", pa.dictionary(pa.int32(), pa.string())),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_length", pa.int32(), nullable=False),
        pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("raw_reward", pa.float32()),  # null where status is "failed"
        pa.field("advantage", pa.float32()),
        pa.field("status", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("weight_version", pa.int64(), nullable=False),
        pa.field("label", pa.string()),
        pa.field("prompt", pa.string()),  # the prompt text the model was given (after any chat template)
    ],
    metadata={"schema_version": SCHEMA_VERSION},
)


def samples_table(
    requests: Sequence[GenerateRequest],
    results: Sequence[GenerateResult],
    *,
    rollout_id: int,
    first_index: int,
    group_index: Sequence[int],
    raw_reward: Sequence[float | None],
    status: Sequence[str],
    label: Sequence[str],
    prompt: Sequence[str] | None = None,
    advantage: Sequence[float] | None = None,
) -> pa.Table:
    """The rollout table of generated samples: request i and its result i make row i, numbered from `first_index`;
    every response token is trained on (loss mask 1). `advantage` is left null when not given (`get` fills it)."""
    count = len(results)
    lengths = [len(r.output_ids) for r in results]
    return pa.Table.from_pydict(
        {
            "rollout_id": pa.array(np.full(count, rollout_id), pa.int64()),
            "sample_index": pa.array(np.arange(first_index, first_index + count), pa.int64()),
            "group_index": pa.array(group_index, pa.int64()),
            "adapter": pa.array([q.adapter for q in requests], pa.string())
            .dictionary_encode()
            .cast(ROLLOUT_SCHEMA.field("adapter").type),
            "prompt_ids": pa.array([q.prompt_ids for q in requests], pa.list_(pa.int32())),
            "response_ids": pa.array([r.output_ids for r in results], pa.list_(pa.int32())),
            "response_length": pa.array(lengths, pa.int32()),
            "rollout_logprobs": pa.array([r.logprobs for r in results], pa.list_(pa.float32())),
            "loss_mask": pa.array([[1] * k for k in lengths], pa.list_(pa.int8())),
            "raw_reward": pa.array(raw_reward, pa.float32()),
            "advantage": pa.nulls(count, pa.float32()) if advantage is None else pa.array(advantage, pa.float32()),
            "status": pa.array(status, pa.string()).dictionary_encode().cast(ROLLOUT_SCHEMA.field("status").type),
            "weight_version": pa.array([r.weight_version for r in results], pa.int64()),
            "label": pa.array(label, pa.string()),
            "prompt": pa.nulls(count, pa.string()) if prompt is None else pa.array(prompt, pa.string()),
        },
        schema=ROLLOUT_SCHEMA,
    )


def with_rollout_metadata(table: pa.Table, **entries: str | int) -> pa.Table:
    meta = dict(table.schema.metadata or {})
    meta.update({k.encode(): str(v).encode() for k, v in entries.items()})
    return table.replace_schema_metadata(meta)


def rollout_metadata(table: pa.Table) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}


def upgraded(table: pa.Table) -> pa.Table:
    """A table of an earlier schema version in today's: version 2 had no prompt text (null)."""
    if rollout_metadata(table).get("schema_version") == "2" and "prompt" not in table.column_names:
        table = table.append_column(ROLLOUT_SCHEMA.field("prompt"), pa.nulls(table.num_rows, pa.string()))
        meta = dict(table.schema.metadata or {})
        meta[b"schema_version"] = SCHEMA_VERSION.encode()
        table = table.replace_schema_metadata(meta)
    return table


def check_schema(table: pa.Table, source: str) -> None:
    expected = ROLLOUT_SCHEMA.remove_metadata()
    actual = table.schema.remove_metadata()
    if actual.equals(expected):
        return
    problems = []
    missing = [name for name in expected.names if name not in actual.names]
    if missing:
        problems.append(f"missing columns {missing}")
    for field in expected:
        if field.name in actual.names and not actual.field(field.name).equals(field):
            found = actual.field(field.name)
            nullability = "" if found.nullable == field.nullable else " (nullability differs)"
            problems.append(f"{field.name} is {found.type}{nullability}, expected {field.type}")
    extra = [name for name in actual.names if name not in expected.names]
    if extra:
        problems.append(f"unexpected columns {extra}")
    raise ValueError(f"{source}: not a rollout table: {'; '.join(problems) or 'column order differs'}")
