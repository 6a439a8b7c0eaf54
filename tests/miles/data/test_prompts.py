"""Prompts for chat models: messages and strings through the model's own chat template."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from miles.config import DataConfig
from miles.data import load_rows
from miles.data.prompts import PromptFormatter
from tests.helpers.chat import build_chat_tokenizer

MESSAGES = [
    {"role": "system", "content": "You are a careful solver."},
    {"role": "user", "content": "What is 12+30? Put the answer in \\boxed{}."},
]


@pytest.fixture(scope="module")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    return build_chat_tokenizer(["system user assistant What is 12+30? Put the answer in \\boxed{}. careful"])


def _template_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]


def test_messages_give_exactly_the_chat_templates_ids(chat_tokenizer):
    prompts = PromptFormatter(chat_tokenizer, DataConfig(task=None, path="x.jsonl"))
    texts, ids = prompts.encode([MESSAGES, MESSAGES[1:]])
    assert ids == [_template_ids(chat_tokenizer, MESSAGES), _template_ids(chat_tokenizer, MESSAGES[1:])]
    assert (
        texts[1] == "<|im_start|>user\nWhat is 12+30? Put the answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_string_goes_through_the_template_as_a_user_message_after_the_system_prompt(chat_tokenizer):
    data = DataConfig(task=None, path="x.jsonl", apply_chat_template=True, system_prompt=MESSAGES[0]["content"])
    _, ids = PromptFormatter(chat_tokenizer, data).encode([MESSAGES[1]["content"]])
    assert ids == [_template_ids(chat_tokenizer, MESSAGES)]
    # messages with a system message of their own keep it
    own = [{"role": "system", "content": "Be brief."}, MESSAGES[1]]
    assert PromptFormatter(chat_tokenizer, data).encode([own])[1] == [_template_ids(chat_tokenizer, own)]


def test_a_plain_string_is_tokenized_as_the_tokenizer_does(chat_tokenizer):
    texts, ids = PromptFormatter(chat_tokenizer, DataConfig(task=None, path="x.jsonl")).encode(["What is 12+30?"])
    assert texts == ["What is 12+30?"] and ids == [chat_tokenizer("What is 12+30?")["input_ids"]]
    assert ids[0][0] == chat_tokenizer.bos_token_id  # the tokenizer's own special tokens, unlike a templated prompt


def test_a_template_the_tokenizer_lacks_is_refused_with_the_model(chat_tokenizer):
    bare = PreTrainedTokenizerFast(tokenizer_object=chat_tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match=r"row 2 holds chat messages, but the tokenizer of /models/base has no chat"):
        PromptFormatter(bare, DataConfig(task=None, path="x.jsonl")).check(["plain", MESSAGES], "/models/base")
    forced = DataConfig(task=None, path="x.jsonl", apply_chat_template=True)
    with pytest.raises(ValueError, match="data.apply_chat_template is true, but the tokenizer"):
        PromptFormatter(bare, forced).check(["plain"], "/models/base")
    lonely = DataConfig(task=None, path="x.jsonl", system_prompt="hi")
    with pytest.raises(ValueError, match="data.system_prompt goes into the chat template, which no prompt goes"):
        PromptFormatter(chat_tokenizer, lonely).check(["plain"], "/models/base")


def test_a_dataset_of_messages_loads_and_bad_messages_name_file_row_and_message(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": MESSAGES, "answer": "42"}) + "\n")
    data = DataConfig(task=None, path=str(path), prompt_key="messages", label_key="answer")
    assert load_rows(data) == [{"prompt": MESSAGES, "label": "42", "row": 1}]

    path.write_text(json.dumps({"messages": MESSAGES, "answer": "42"}) + "\n")
    off = data.model_copy(update={"apply_chat_template": False})
    with pytest.raises(ValueError, match=r"row 1: 'messages' holds chat messages, .*must not be false"):
        load_rows(off)
    bad = [MESSAGES[0], {"role": "user", "content": None}]
    path.write_text(
        json.dumps({"messages": MESSAGES, "answer": "1"}) + "\n" + json.dumps({"messages": bad, "answer": "2"})
    )
    with pytest.raises(ValueError, match=rf"{path}: row 2: 'messages': message 1 \(user\) has no text content"):
        load_rows(data)
