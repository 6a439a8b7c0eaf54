"""Load prompt/label rows with errors that name the file and row: a JSONL, Parquet or Arrow file; a directory saved
by Hugging Face `datasets` (`save_to_disk`, one split picked by data.split); a directory or glob of Parquet shards.
Only the prompt and label columns are read into Python, once per run (epochs reorder indices, not rows)."""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from miles.config import DataConfig
from miles.data.prompts import PromptFormatter
from miles.envs import task_rows

_SHARD = re.compile(r"^(.+?)-\d{5}-of-\d{5}\.parquet$")
ROW = "row"  # a row's number in its source, as errors name it: the line of a JSONL file, else its position


def load_rows(config: DataConfig) -> list[dict]:
    """The dataset's rows as {"prompt", "label"} dicts, from the built-in task or the file; a prompt is a string or
    chat messages."""
    if config.task is not None:
        return task_rows(config.task)
    source, records = _read_records(config.path, config.split, [config.prompt_key, config.label_key or ""])
    return _rows(source, records, config.prompt_key, config.label_key, config.apply_chat_template)


def check_prompt_tokens(
    rows: list[dict],
    prompts: PromptFormatter,
    max_new_tokens: int,
    context: int,
    source: str,
    budget_field: str = "rollout.max_new_tokens",
) -> None:
    """Raise for the first row whose prompt (as the model is given it) leaves no room for max_new_tokens (the value of
    `budget_field`) within the model's context, or holds a character the tokenizer knows no token for (its unknown
    token would be trained on in the character's place).

    A prompt is at least its characters / the longest token's characters tokens long: one longer than the context
    allows by that count alone is refused without tokenizing it (a 50 MB line took minutes and gigabytes)."""
    tokenizer = prompts.tokenizer
    unknown = _unknown_token_id(tokenizer)
    longest_token = max(map(len, tokenizer.get_vocab()))
    room = context - max_new_tokens
    texts = [prompts.text(r["prompt"]) for r in rows]
    to_tokenize = [i for i, text in enumerate(texts) if len(text) <= room * longest_token]
    tokens = dict(zip(to_tokenize, prompts.encode([rows[i]["prompt"] for i in to_tokenize])[1], strict=True))
    for index, row in enumerate(rows):
        where = f"{source}: row {row.get(ROW, index + 1)}"
        if index not in tokens:
            at_least = -(-len(texts[index]) // longest_token)
            length = f"{len(texts[index]):,} characters, so at least {at_least:,} tokens"
        elif len(tokens[index]) > room:
            length = f"{len(tokens[index])} tokens"
        else:
            if unknown is not None and unknown in tokens[index]:
                characters = sorted(
                    {c for c in texts[index] if unknown in tokenizer.encode(c, add_special_tokens=False)}
                )
                raise ValueError(
                    f"{where}: the prompt holds characters the tokenizer has no token for: {''.join(characters)!r} "
                    f"(they would become its unknown token {tokenizer.convert_ids_to_tokens(unknown)!r})"
                )
            continue
        raise ValueError(
            f"{where}: the prompt is {length}; with {budget_field}={max_new_tokens} "
            f"it exceeds the model's context of {context} tokens (max_position_embeddings)"
        )


def _unknown_token_id(tokenizer) -> int | None:
    """The id a character outside the vocabulary becomes, where the tokenizer's model has one (a byte-level BPE has
    none; the embedded tokenizer's is its pad token, which the Hugging Face wrapper does not report as unk_token)."""
    if tokenizer.unk_token_id is not None:
        return tokenizer.unk_token_id
    backend = getattr(tokenizer, "backend_tokenizer", None)
    token = getattr(backend.model, "unk_token", None) if backend is not None else None
    return backend.token_to_id(token) if token else None


def _read_records(spec: str, split: str | None, columns: list[str]) -> tuple[str, list]:
    """(what to call the source in errors, its records as dicts of `columns`) from a file, a directory or a glob."""
    if glob.has_magic(spec):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"data.path: {spec} matches no file")
        return spec, _parquet_records(files, columns, spec)
    path = Path(spec)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return _saved_dataset(path, split, columns)
        return _parquet_shards(path, split, columns)
    if not path.is_file():
        raise ValueError(f"data.path: {path} does not exist")
    if split is not None:
        raise ValueError(f"data.split={split}: {path} is one file; splits are directories or shard names")
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            return str(path), _jsonl_records(path)
        if suffix == ".parquet":
            return str(path), _parquet_records([path], columns, str(path))
        if suffix in (".arrow", ".feather"):
            with pa.memory_map(str(path), "r") as source:
                return str(path), _records(pa.ipc.open_file(source).read_all(), columns)
    except (OSError, pa.ArrowInvalid) as exc:
        raise ValueError(f"data.path: cannot read {path}: {exc}") from None
    raise ValueError(f"data.path: {path} has an unknown format; use .jsonl, .parquet or .arrow, or a directory")


def _jsonl_records(path: Path) -> list:
    """The records of a JSONL file, each numbered by its line (`ROW`): a blank line is no record, but it is a line."""
    records = []
    with path.open("rb") as lines:
        for line_no, line in enumerate(lines, start=1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}: row {line_no} is not UTF-8 text (byte {exc.start} of the line)") from None
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: row {line_no} is not valid JSON ({exc.msg})") from None
            if isinstance(record, dict):
                record[ROW] = line_no
            records.append(record)
    return records


def _records(table: pa.Table, columns: list[str]) -> list[dict]:
    """The rows of the columns the run reads (not the whole table) as dicts."""
    return table.select([c for c in dict.fromkeys(columns) if c in table.column_names]).to_pylist()


def _parquet_records(files: list[Path], columns: list[str], source: str) -> list[dict]:
    try:
        return [row for path in files for row in _records(pq.read_table(path), columns)]
    except (OSError, pa.ArrowInvalid) as exc:
        raise ValueError(f"data.path: cannot read {source}: {exc}") from None


def _saved_dataset(path: Path, split: str | None, columns: list[str]) -> tuple[str, list]:
    """A directory written by Hugging Face `datasets` (`save_to_disk`): one dataset, or one split of several."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"data.path: {path} is a directory saved by Hugging Face datasets; reading it needs that library: "
            "pip install 'miles-flow[datasets]'"
        ) from None
    loaded = datasets.load_from_disk(str(path))
    source = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        name = split or ("train" if "train" in loaded else None)
        if name not in loaded:
            raise ValueError(f"data.split: {path} has the splits {sorted(loaded)}; set data.split to one of them")
        loaded, source = loaded[name], f"{path} (split {name})"
    elif split is not None:
        raise ValueError(f"data.split={split}: {path} is a single dataset, not a set of splits")
    return source, loaded.select_columns([c for c in dict.fromkeys(columns) if c in loaded.column_names]).to_list()


def _parquet_shards(path: Path, split: str | None, columns: list[str]) -> tuple[str, list]:
    """A directory of parquet shards, as `datasets` and the Hub keep them: `<split>-00000-of-00002.parquet`
    files, or one directory per split; without data.split, the `train` split when there are several."""
    files = sorted(path.rglob("*.parquet"))
    if not files:
        raise ValueError(f"data.path: {path} holds no .parquet files (nor a dataset saved by Hugging Face datasets)")
    by_split: dict[str, list[Path]] = {}
    for file in files:
        by_split.setdefault(_split_of(file, path), []).append(file)
    name = split or ("train" if len(by_split) > 1 else next(iter(by_split)))
    if name not in by_split:
        raise ValueError(f"data.split: {path} has the splits {sorted(by_split)}; set data.split to one of them")
    return f"{path} (split {name})", _parquet_records(by_split[name], columns, str(path))


def _split_of(file: Path, root: Path) -> str:
    """The split a shard belongs to: the name before `-00000-of-00002`, else its directory under `root`."""
    match = _SHARD.match(file.name)
    if match:
        return match.group(1)
    parts = file.relative_to(root).parts
    return parts[-2] if len(parts) > 1 else "train"


def _rows(
    source: str, records: list, prompt_key: str, label_key: str | None, apply_chat_template: bool | None
) -> list[dict]:
    if not records:
        raise ValueError(f"data.path: {source} holds no rows")
    rows = []
    for position, record in enumerate(records, start=1):
        index = record.get(ROW, position) if isinstance(record, dict) else position
        if not isinstance(record, dict) or prompt_key not in record:
            raise ValueError(f"{source}: row {index} has no {prompt_key!r} column (data.prompt_key)")
        prompt = record[prompt_key]
        if isinstance(prompt, list):
            _check_messages(prompt, f"{source}: row {index}: {prompt_key!r}")
            if apply_chat_template is False:
                raise ValueError(
                    f"{source}: row {index}: {prompt_key!r} holds chat messages, which go through the chat template: "
                    "data.apply_chat_template must not be false"
                )
        elif not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{source}: row {index}: {prompt_key!r} must be a non-empty string or chat messages")
        label = None if label_key is None else record.get(label_key)
        if label_key is not None and label is None:
            raise ValueError(
                f"{source}: row {index} has no {label_key!r} value (data.label_key; set it to null for data without labels)"
            )
        rows.append({"prompt": prompt, "label": "" if label is None else str(label), ROW: index})
    return rows


def _check_messages(messages: list, where: str) -> None:
    if not messages:
        raise ValueError(f"{where}: holds no messages")
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: message {position} must be a {{role, content}} object")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {position} ({message['role']}) has no text content")
