"""The rollout table: one row per sample (a completion, or a whole multi-turn episode), the handover format
between rollout and trainer.

A sample whose reward could not be computed has status "failed" and a null raw_reward; it stays in the
stored rollout and is never trained on. `response_ids` holds every token after the prompt: in an episode the
model's turns (loss_mask 1, with their log-probs) and the environment's replies (loss_mask 0, log-prob 0).
`num_turns` counts the model's turns, `end_reason` says why the sample ended (miles.envs.base.END_REASONS).
`weight_versions` holds each response token's weight version: a weight push in the middle of a generation (the
fully-async flow) changes it from the next token on; `weight_version` is the oldest of them.
`token_rewards`, where the sample has them, is the reward credited at each response token (an environment's reward
of a turn at that turn's last token: a process reward); they add up to `raw_reward`. Null: the whole reward at the
last trained token (a completion scored at its end). `baseline_reward` is the reward of a greedy response to the
sample's prompt, generated with the rollout for algo.advantage_estimator=remax (null otherwise, and where that
reward failed).

Versions: 2 had no prompt text, 3 no num_turns or end_reason, 4 no weight_versions, 5 no token_rewards or
baseline_reward; their files are read, the missing columns filled (null prompt, end_reason, token_rewards and
baseline_reward, one turn, every token of the sample's weight_version).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from miles.rollout.generation import SampleRecord

SCHEMA_VERSION = "6"
STATUSES = ("completed", "truncated", "failed")

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
        pa.field("num_turns", pa.int32(), nullable=False),
        pa.field("end_reason", pa.dictionary(pa.int8(), pa.string())),  # null in files of schema versions 2 and 3
        pa.field("weight_versions", pa.list_(pa.int32()), nullable=False),
        pa.field("token_rewards", pa.list_(pa.float32())),  # null: the whole reward at the last trained token
        pa.field("baseline_reward", pa.float32()),  # the prompt's greedy response's reward (remax); else null
    ],
    metadata={"schema_version": SCHEMA_VERSION},
)


def records_table(
    records: Sequence[SampleRecord],
    *,
    rollout_id: int,
    first_index: int,
    group_index: Sequence[int],
    adapter: Sequence[str | None],
    label: Sequence[str | None],
    advantage: Sequence[float] | None = None,
    baseline_reward: Sequence[float | None] | None = None,
) -> pa.Table:
    """The rollout table of produced samples, record i making row i, numbered from `first_index`. `advantage` is
    left null when not given (`get` fills it), and so is `baseline_reward`."""
    count = len(records)
    return pa.Table.from_pydict(
        {
            "rollout_id": pa.array(np.full(count, rollout_id), pa.int64()),
            "sample_index": pa.array(np.arange(first_index, first_index + count), pa.int64()),
            "group_index": pa.array(group_index, pa.int64()),
            "adapter": _dictionary(adapter, "adapter"),
            "prompt_ids": pa.array([r.prompt_ids for r in records], pa.list_(pa.int32())),
            "response_ids": pa.array([r.response_ids for r in records], pa.list_(pa.int32())),
            "response_length": pa.array([len(r.response_ids) for r in records], pa.int32()),
            "rollout_logprobs": pa.array([r.rollout_logprobs for r in records], pa.list_(pa.float32())),
            "loss_mask": pa.array([r.loss_mask for r in records], pa.list_(pa.int8())),
            "raw_reward": pa.array([r.reward for r in records], pa.float32()),
            "advantage": pa.nulls(count, pa.float32()) if advantage is None else pa.array(advantage, pa.float32()),
            "status": _dictionary([r.status for r in records], "status"),
            "weight_version": pa.array([r.weight_version for r in records], pa.int64()),
            "label": pa.array(label, pa.string()),
            "prompt": pa.array([r.prompt for r in records], pa.string()),
            "num_turns": pa.array([r.num_turns for r in records], pa.int32()),
            "end_reason": _dictionary([r.end_reason for r in records], "end_reason"),
            "weight_versions": pa.array([r.weight_versions for r in records], pa.list_(pa.int32())),
            "token_rewards": pa.array([r.token_rewards for r in records], pa.list_(pa.float32())),
            "baseline_reward": pa.nulls(count, pa.float32())
            if baseline_reward is None
            else pa.array(baseline_reward, pa.float32()),
        },
        schema=ROLLOUT_SCHEMA,
    )


def _dictionary(values: Sequence[str | None], column: str) -> pa.Array:
    return pa.array(values, pa.string()).dictionary_encode().cast(ROLLOUT_SCHEMA.field(column).type)


def with_rollout_metadata(table: pa.Table, **entries: str | int) -> pa.Table:
    meta = dict(table.schema.metadata or {})
    meta.update({k.encode(): str(v).encode() for k, v in entries.items()})
    return table.replace_schema_metadata(meta)


def rollout_metadata(table: pa.Table) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}


def upgraded(table: pa.Table) -> pa.Table:
    """A table of an earlier schema version in today's: version 2 had no prompt text (null), versions 2 and 3 no
    num_turns (one turn) or end_reason (null), versions 2 to 4 no weight_versions (each token of its sample's
    weight_version), versions 2 to 5 no token_rewards (null)."""
    version = rollout_metadata(table).get("schema_version")
    if version not in ("2", "3", "4", "5"):
        return table
    rows = table.num_rows
    if "prompt" not in table.column_names:
        table = table.append_column(ROLLOUT_SCHEMA.field("prompt"), pa.nulls(rows, pa.string()))
    if "num_turns" not in table.column_names:
        table = table.append_column(ROLLOUT_SCHEMA.field("num_turns"), pa.array(np.ones(rows), pa.int32()))
        table = table.append_column(
            ROLLOUT_SCHEMA.field("end_reason"),
            pa.nulls(rows, pa.string()).cast(ROLLOUT_SCHEMA.field("end_reason").type),
        )
    if "weight_versions" not in table.column_names:
        lengths = table.column("response_length").to_numpy()
        versions = np.repeat(table.column("weight_version").to_numpy(), lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(versions, pa.int32()))
        table = table.append_column(ROLLOUT_SCHEMA.field("weight_versions"), column)
    if "token_rewards" not in table.column_names:
        table = table.append_column(ROLLOUT_SCHEMA.field("token_rewards"), pa.nulls(rows, pa.list_(pa.float32())))
        table = table.append_column(ROLLOUT_SCHEMA.field("baseline_reward"), pa.nulls(rows, pa.float32()))
    meta = dict(table.schema.metadata or {})
    meta[b"schema_version"] = SCHEMA_VERSION.encode()
    return table.replace_schema_metadata(meta)


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
