"""miles.models.tiny: the character tokenizer and the embedded Llama model directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miles.models import build_tokenizer
from miles.models.tiny import BOS, CHARACTERS, EOS, PAD


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _char_ids(tok, text: str) -> list[int]:
    return [tok.convert_tokens_to_ids(ch) for ch in text]


def test_special_tokens(tok):
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, EOS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.padding_side == "left"
    assert len(tok) == 3 + len(CHARACTERS)


def test_one_id_per_character_after_bos(tok):
    ids = tok("12+34=")["input_ids"]
    char_ids = _char_ids(tok, "12+34=")
    assert ids == [tok.bos_token_id] + char_ids
    assert len(ids) == 1 + len("12+34=")
    # Distinct characters get distinct ids, none of them special.
    assert len(set(_char_ids(tok, CHARACTERS))) == len(CHARACTERS)
    assert not set(_char_ids(tok, CHARACTERS)) & {0, 1, 2}
    # Same character, same id: "1" and "2"... at positions 1/2 of "12+34=" and "21".
    assert tok("21")["input_ids"] == [tok.bos_token_id, char_ids[1], char_ids[0]]


def test_without_special_tokens(tok):
    assert tok("7-8", add_special_tokens=False)["input_ids"] == _char_ids(tok, "7-8")


def test_decode_round_trip(tok):
    for text in ["12+34=", "0", "99+99=198", "5-3=2"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == text
    ids = tok("1+2=")["input_ids"] + _char_ids(tok, "3") + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "1+2=3"


def test_left_padding(tok):
    batch = tok(["1+2=", "10+20="], padding=True)
    long_ids = tok("10+20=")["input_ids"]
    short_ids = tok("1+2=")["input_ids"]
    assert batch["input_ids"][1] == long_ids
    assert batch["input_ids"][0] == [tok.pad_token_id] * 2 + short_ids
    assert batch["attention_mask"][0] == [0, 0] + [1] * len(short_ids)


def test_save_and_load_with_auto_tokenizer(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["12+34=", "7+0=", "99-1="]
    for text in texts:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.padding_side == "left"
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded(texts, padding=True)["input_ids"] == tok(texts, padding=True)["input_ids"]
    assert loaded(texts, padding=True)["input_ids"][1][0] == loaded.pad_token_id


def test_tokenizer_saved_next_to_the_model_config_loads_back_unchanged(tok, tmp_path):
    """A model dir holds config.json next to the tokenizer files; AutoTokenizer must give back the same
    vocabulary (not the architecture's registered tokenizer), so every id it can produce has an embedding row."""
    from transformers import AutoTokenizer

    from miles.config import ModelConfig
    from miles.models.tiny import build_tiny_model

    build_tiny_model(ModelConfig(), len(tok), seed=0).config.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("12+34=")["input_ids"] == tok("12+34=")["input_ids"]
    assert loaded.get_vocab() == tok.get_vocab()
    assert len(loaded) == len(tok)


def test_tiny_model_dir(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tiny_model_dir / name).is_file(), name

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.model_type == "llama"
    assert model.config.architectures == ["LlamaForCausalLM"]
    n_params = sum(p.numel() for p in model.parameters())
    assert 1e5 <= n_params <= 5e6
    reference = build_tokenizer()
    texts = ["12+34=", "1+2=", "99+99="]
    for text in texts:
        assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    assert tokenizer.padding_side == "left"
    assert tokenizer(texts, padding=True)["input_ids"] == reference(texts, padding=True)["input_ids"]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_tiny_model_dir_tokenizer_fits_the_embedding(tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tokenizer) <= config.vocab_size
    assert max(tokenizer.get_vocab().values()) < config.vocab_size


def test_a_tool_task_grows_the_tokenizer_by_the_tools_markup():
    from miles.envs.calculator import TOOL_TOKENS
    from miles.models.tiny import tool_tokens

    assert tool_tokens(["addition"]) == () and tool_tokens(["sums"]) == TOOL_TOKENS
    tok = build_tokenizer(TOOL_TOKENS)
    assert len(tok) == 3 + len(CHARACTERS) + len(TOOL_TOKENS)
    ids = tok("<calc>12+3</calc><result>15</result>", add_special_tokens=False)["input_ids"]
    assert ids == [
        tok.convert_tokens_to_ids("<calc>"),
        *_char_ids(tok, "12+3"),
        tok.convert_tokens_to_ids("</calc>"),
    ] + [
        tok.convert_tokens_to_ids("<result>"),
        *_char_ids(tok, "15"),
        tok.convert_tokens_to_ids("</result>"),
    ]
    # Kept when decoding without special tokens: the environment reads the call from the text.
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "<calc>12+3</calc><result>15</result>"
    assert build_tokenizer()("12+3=")["input_ids"] == tok("12+3=")["input_ids"]


BUILD = """
import logging, sys
from pathlib import Path
from miles.config import ModelConfig, WarmupConfig
from miles.models import ensure_embedded_model
logging.basicConfig(level=logging.INFO, format="%(message)s")
config = ModelConfig(warmup=WarmupConfig(max_steps=20, eval_every=20, target_accuracy=1.0))
print(ensure_embedded_model(config, ["addition"], seed=0, cache_root=Path(sys.argv[1])))
"""


def test_processes_starting_the_same_model_at_once_build_it_once(tmp_path):
    starts = [
        subprocess.Popen([sys.executable, "-c", BUILD, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    outputs = [start.communicate(timeout=300) for start in starts]
    assert [start.returncode for start in starts] == [0, 0], [err.decode()[-2000:] for _, err in outputs]
    directories = {out.decode().split()[-1] for out, _ in outputs}
    assert len(directories) == 1 and (Path(directories.pop()) / "warmup.json").exists()
    assert sum(err.decode().count("embedded model ready") for _, err in outputs) == 1
    assert not list(tmp_path.glob(".build-*"))
