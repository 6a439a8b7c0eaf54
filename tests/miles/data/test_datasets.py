"""miles.data.datasets: prompt files in JSONL, Parquet and Arrow, errors that name file and row, prompt lengths."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from miles.config import DataConfig
from miles.data import check_prompt_tokens, load_rows
from miles.data.prompts import PromptFormatter
from miles.envs import task_rows

RECORDS = [
    {"question": "1+1=", "answer": 2, "extra": "x"},
    {"question": "what is 3+4?", "answer": "7", "extra": "y"},
    {"question": "zero", "answer": 0, "extra": "z"},
]
EXPECTED = [
    {"prompt": "1+1=", "label": "2"},
    {"prompt": "what is 3+4?", "label": "7"},
    {"prompt": "zero", "label": "0"},
]


def _prompts_and_labels(rows: list[dict]) -> list[dict]:
    return [{"prompt": r["prompt"], "label": r["label"]} for r in rows]


def _config(path, prompt_key="question", label_key="answer") -> DataConfig:
    return DataConfig(task=None, path=str(path), prompt_key=prompt_key, label_key=label_key)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _arrow_table(records):
    return pa.table(
        {
            "question": [r["question"] for r in records],
            "answer": [None if r["answer"] is None else str(r["answer"]) for r in records],
            "extra": [r["extra"] for r in records],
        }
    )


def test_task_rows_when_task_is_set():
    assert load_rows(DataConfig()) == task_rows("addition")


def test_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", RECORDS)
    assert _prompts_and_labels(load_rows(_config(path))) == EXPECTED


def test_jsonl_skips_blank_lines_and_numbers_rows_by_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n" + json.dumps(RECORDS[0]) + "\n   \n" + json.dumps(RECORDS[1]) + "\n\n")
    rows = load_rows(_config(path))
    assert _prompts_and_labels(rows) == EXPECTED[:2] and [r["row"] for r in rows] == [2, 4]
    path.write_text("\n" + json.dumps(RECORDS[0]) + "\n\n" + json.dumps({"question": ""}) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}: row 4: 'question' must be a non-empty string"):
        load_rows(_config(path))


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(json.dumps(RECORDS[0]).encode() + b"\n" + b'{"question": "caf\xe9", "answer": 1}\n')
    with pytest.raises(ValueError, match=rf"^{path}: row 2 is not UTF-8 text \(byte 17 of the line\)$"):
        load_rows(_config(path))


@pytest.mark.parametrize(
    "records",
    [
        [{"question": "q1", "answer": 1}, {"question": "q2"}],
        [{"question": "q1", "answer": 1}, {"question": "q2", "answer": None}],
    ],
)
def test_missing_label_names_file_row_and_field(tmp_path, records):
    path = _write_jsonl(tmp_path / "p.jsonl", records)
    with pytest.raises(ValueError, match=rf"{path}: row 2 has no 'answer' value \(data.label_key"):
        load_rows(_config(path))


def test_data_without_labels_when_label_key_is_null(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"question": "q1"}, {"question": "q2", "answer": 5}])
    assert _prompts_and_labels(load_rows(_config(path, label_key=None))) == [
        {"prompt": "q1", "label": ""},
        {"prompt": "q2", "label": ""},
    ]


def test_parquet(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(_arrow_table(RECORDS), path)
    assert _prompts_and_labels(load_rows(_config(path))) == EXPECTED


def test_arrow_ipc_file(tmp_path):
    path = tmp_path / "p.arrow"
    table = _arrow_table(RECORDS)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert _prompts_and_labels(load_rows(_config(path))) == EXPECTED


def test_feather_suffix_and_upper_case_suffix(tmp_path):
    feather_path = tmp_path / "p.feather"
    feather.write_feather(_arrow_table(RECORDS), feather_path, compression="uncompressed")
    assert _prompts_and_labels(load_rows(_config(feather_path))) == EXPECTED
    upper = _write_jsonl(tmp_path / "P.JSONL", RECORDS)
    assert _prompts_and_labels(load_rows(_config(upper))) == EXPECTED


def test_default_keys(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "label": "b"}])
    config = DataConfig(task=None, path=str(path))
    assert _prompts_and_labels(load_rows(config)) == [{"prompt": "a", "label": "b"}]


def test_bad_json_line_names_file_and_row(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(RECORDS[1]) + "\n{not json\n")
    with pytest.raises(ValueError) as info:
        load_rows(_config(path))
    assert str(path) in str(info.value)
    assert "row 3" in str(info.value)


def test_missing_prompt_column_names_row(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [RECORDS[0], RECORDS[1], {"answer": 1}])
    with pytest.raises(ValueError) as info:
        load_rows(_config(path))
    message = str(info.value)
    assert str(path) in message
    assert "row 3" in message
    assert "question" in message


def test_missing_prompt_column_in_parquet(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(_arrow_table(RECORDS), path)
    with pytest.raises(ValueError) as info:
        load_rows(_config(path, prompt_key="prompt"))
    assert str(path) in str(info.value)
    assert "row 1" in str(info.value)
    assert "'prompt'" in str(info.value)


def test_non_object_json_row(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match="row 2"):
        load_rows(_config(path))


@pytest.mark.parametrize("prompt", ["", 12, None])
def test_prompt_must_be_non_empty_string(tmp_path, prompt):
    path = _write_jsonl(tmp_path / "p.jsonl", [RECORDS[0], {"question": prompt, "answer": "1"}])
    with pytest.raises(ValueError, match="row 2") as info:
        load_rows(_config(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match="no rows") as info:
        load_rows(_config(path))
    assert str(path) in str(info.value)


def test_unknown_suffix(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("question,answer\n1+1=,2\n")
    with pytest.raises(ValueError, match="unknown format") as info:
        load_rows(_config(path))
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    path = tmp_path / "absent.jsonl"
    with pytest.raises(ValueError, match="data.path") as info:
        load_rows(_config(path))
    assert str(path) in str(info.value)


def test_directory_is_not_a_file(tmp_path):
    path = tmp_path / "dir.jsonl"
    path.mkdir()
    with pytest.raises(ValueError, match="data.path"):
        load_rows(_config(path))


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "p.parquet"
    path.write_bytes(b"this is not parquet at all")
    with pytest.raises(ValueError, match="data.path") as info:
        load_rows(_config(path))
    assert str(path) in str(info.value)


def test_prompts_that_fit_the_context_pass_even_when_one_fills_it_exactly(tokenizer):
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "12+34=", "label": "46"}]
    longest = max(len(ids) for ids in tokenizer([r["prompt"] for r in rows])["input_ids"])
    check_prompt_tokens(
        rows, PromptFormatter(tokenizer, DataConfig()), max_new_tokens=4, context=longest + 4, source="task addition"
    )


def test_a_prompt_too_long_for_the_context_names_file_and_row(tmp_path, tokenizer):
    path = _write_jsonl(
        tmp_path / "p.jsonl", [{"question": "1+1="}, {"question": "1+1=" * 50}, {"question": "2+2=" * 60}]
    )
    rows = load_rows(_config(path, label_key=None))
    lengths = [len(ids) for ids in tokenizer([r["prompt"] for r in rows])["input_ids"]]
    context = lengths[0] + 100
    assert lengths[1] + 8 > context  # so rows 2 and 3 are both too long, and the first of them is named

    with pytest.raises(ValueError) as info:
        check_prompt_tokens(
            rows, PromptFormatter(tokenizer, DataConfig()), max_new_tokens=8, context=context, source=str(path)
        )
    assert str(info.value) == (
        f"{path}: row 2: the prompt is {lengths[1]} tokens; with rollout.max_new_tokens=8 it exceeds the model's "
        f"context of {context} tokens (max_position_embeddings)"
    )


def test_one_token_over_the_context_is_too_long(tokenizer):
    rows = [{"prompt": "9+9=", "label": "18"}]
    length = len(tokenizer(["9+9="])["input_ids"][0])
    with pytest.raises(ValueError, match="task addition: row 1: .* exceeds the model's context"):
        check_prompt_tokens(
            rows, PromptFormatter(tokenizer, DataConfig()), max_new_tokens=4, context=length + 3, source="task addition"
        )


def _saved(tmp_path, splits: dict[str, list[dict]]):
    import datasets

    path = tmp_path / "saved"
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(path)
    return path


def test_a_directory_saved_by_datasets_reads_its_split(tmp_path):
    records = [{"question": r["question"], "answer": str(r["answer"]), "extra": r["extra"]} for r in RECORDS]
    path = _saved(tmp_path, {"train": records, "test": records[:1]})
    assert _prompts_and_labels(load_rows(_config(path))) == EXPECTED  # train unless data.split says otherwise
    test = _config(path).model_copy(update={"split": "test"})
    assert _prompts_and_labels(load_rows(test)) == EXPECTED[:1]
    with pytest.raises(ValueError, match=r"data.split: .* has the splits \['test', 'train'\]"):
        load_rows(_config(path).model_copy(update={"split": "validation"}))


def test_a_single_saved_dataset_and_its_bad_rows_are_named(tmp_path):
    import datasets

    path = tmp_path / "one"
    datasets.Dataset.from_list([{"question": "1+1=", "answer": "2"}, {"question": "", "answer": "3"}]).save_to_disk(
        path
    )
    with pytest.raises(ValueError, match=rf"{path}: row 2: 'question' must be a non-empty string"):
        load_rows(_config(path))
    with pytest.raises(ValueError, match="is a single dataset, not a set of splits"):
        load_rows(_config(path).model_copy(update={"split": "train"}))


def test_parquet_shards_by_split_in_a_directory_or_a_glob(tmp_path):
    shards = tmp_path / "data"
    shards.mkdir()
    records = [{"question": r["question"], "answer": str(r["answer"])} for r in RECORDS]
    pq.write_table(pa.Table.from_pylist(records[:2]), shards / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(records[2:]), shards / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(records[:1]), shards / "test-00000-of-00001.parquet")
    assert _prompts_and_labels(load_rows(_config(tmp_path))) == EXPECTED  # the train shards, in order
    assert _prompts_and_labels(load_rows(_config(tmp_path).model_copy(update={"split": "test"}))) == EXPECTED[:1]
    assert _prompts_and_labels(load_rows(_config(str(shards / "train-*.parquet")))) == EXPECTED
    with pytest.raises(ValueError, match="matches no file"):
        load_rows(_config(str(shards / "dev-*.parquet")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .parquet files"):
        load_rows(_config(tmp_path / "empty"))


def test_a_huge_prompt_is_refused_without_being_tokenized(tmp_path, tokenizer):
    """A 5 MB line exceeds the context by its characters alone: it is named, and only the short rows reach the
    tokenizer."""
    path = _write_jsonl(tmp_path / "p.jsonl", [{"question": "1+1="}, {"question": "1" * 5_000_000}])
    rows = load_rows(_config(path, label_key=None))
    tokenized: list[str] = []

    class Recording:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, texts, **kwargs):
            tokenized.extend(texts)
            return tokenizer(texts, **kwargs)

    longest_token = max(map(len, tokenizer.get_vocab()))
    with pytest.raises(ValueError) as info:
        check_prompt_tokens(
            rows, PromptFormatter(Recording(), DataConfig()), max_new_tokens=4, context=32, source=str(path)
        )
    at_least = -(-5_000_000 // longest_token)
    assert str(info.value) == (
        f"{path}: row 2: the prompt is 5,000,000 characters, so at least {at_least:,} tokens; with "
        "rollout.max_new_tokens=4 it exceeds the model's context of 32 tokens (max_position_embeddings)"
    )
    assert tokenized == ["1+1="]


def test_characters_the_tokenizer_has_no_token_for_are_refused(tmp_path, tokenizer):
    """The embedded tokenizer maps an unknown character to its pad token, which would be trained on in its place."""
    path = _write_jsonl(tmp_path / "p.jsonl", [{"question": "1+1="}, {"question": "1+x=y"}])
    rows = load_rows(_config(path, label_key=None))
    with pytest.raises(ValueError) as info:
        check_prompt_tokens(rows, PromptFormatter(tokenizer, DataConfig()), max_new_tokens=4, context=32, source="d")
    assert str(info.value) == (
        "d: row 2: the prompt holds characters the tokenizer has no token for: 'xy' (they would become its unknown "
        "token '<pad>')"
    )
