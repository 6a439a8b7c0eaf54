"""Load prompt/label rows from JSONL, Parquet or Arrow files, with errors that name the file and row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from miles.config import DataConfig
from miles.data.prompts import PromptFormatter
from miles.envs import task_rows


def load_rows(config: DataConfig) -> list[dict]:
    """The dataset's rows as {"prompt", "label"} dicts, from the built-in task or the file; a prompt is a string or
    chat messages."""
    if config.task is not None:
        return task_rows(config.task)
    return _read_file(Path(config.path), config.prompt_key, config.label_key, config.apply_chat_template)


def check_prompt_lengths(
    rows: list[dict], prompts: PromptFormatter, max_new_tokens: int, context: int, source: str
) -> None:
    """Raise for the first row whose prompt (as the model is given it) leaves no room for max_new_tokens within the
    model's context."""
    lengths = [len(ids) for ids in prompts.encode([r["prompt"] for r in rows])[1]]
    for index, length in enumerate(lengths, start=1):
        if length + max_new_tokens > context:
            raise ValueError(
                f"{source}: row {index}: the prompt is {length} tokens; with rollout.max_new_tokens={max_new_tokens} "
                f"it exceeds the model's context of {context} tokens (max_position_embeddings)"
            )


def _read_file(path: Path, prompt_key: str, label_key: str | None, apply_chat_template: bool | None) -> list[dict]:
    if not path.is_file():
        raise ValueError(f"data.path: {path} does not exist or is not a file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            records = []
            for line_no, line in enumerate(path.read_text().splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}: row {line_no} is not valid JSON ({exc.msg})") from None
        elif suffix == ".parquet":
            records = pq.read_table(path).to_pylist()
        elif suffix in (".arrow", ".feather"):
            with pa.memory_map(str(path), "r") as source:
                records = pa.ipc.open_file(source).read_all().to_pylist()
        else:
            raise ValueError(f"data.path: {path} has an unknown format; use .jsonl, .parquet or .arrow")
    except (OSError, pa.ArrowInvalid) as exc:
        raise ValueError(f"data.path: cannot read {path}: {exc}") from None
    if not records:
        raise ValueError(f"data.path: {path} holds no rows")
    rows = []
    for index, record in enumerate(records, start=1):
        if not isinstance(record, dict) or prompt_key not in record:
            raise ValueError(f"{path}: row {index} has no {prompt_key!r} column (data.prompt_key)")
        prompt = record[prompt_key]
        if isinstance(prompt, list):
            _check_messages(prompt, f"{path}: row {index}: {prompt_key!r}")
            if apply_chat_template is False:
                raise ValueError(
                    f"{path}: row {index}: {prompt_key!r} holds chat messages, which go through the chat template: "
                    "data.apply_chat_template must not be false"
                )
        elif not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}: row {index}: {prompt_key!r} must be a non-empty string or chat messages")
        label = None if label_key is None else record.get(label_key)
        if label_key is not None and label is None:
            raise ValueError(
                f"{path}: row {index} has no {label_key!r} value (data.label_key; set it to null for data without labels)"
            )
        rows.append({"prompt": prompt, "label": "" if label is None else str(label)})
    return rows


def _check_messages(messages: list, where: str) -> None:
    if not messages:
        raise ValueError(f"{where}: holds no messages")
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: message {position} must be a {{role, content}} object")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {position} ({message['role']}) has no text content")
