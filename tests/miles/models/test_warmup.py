"""The warm-up's supervised sequences: the prompt, then turns; only the model's turns (and their EOS) are labels."""

from __future__ import annotations

from miles.envs.calculator import TOOL_TOKENS, demonstration
from miles.models import build_tokenizer
from miles.models.warmup import IGNORE, _sft_tensors


def test_a_calculator_episode_trains_on_the_models_turns_only():
    tok = build_tokenizer(TOOL_TOKENS)
    rows = [{"prompt": "12+34+56=", "label": "102"}, {"prompt": "1+2+3=", "label": "6"}]
    input_ids, labels = _sft_tensors(tok, rows, [demonstration(rows[0], use_tool=True), [("6", True)]])

    eos = tok.eos_token_id
    prompt = tok("12+34+56=")["input_ids"]
    call = tok("<calc>12+34+56</calc>", add_special_tokens=False)["input_ids"] + [eos]
    result = tok("<result>102</result>", add_special_tokens=False)["input_ids"]
    answer = tok("102", add_special_tokens=False)["input_ids"] + [eos]
    sequence = prompt + call + result + answer
    assert input_ids[0].tolist() == sequence
    assert labels[0].tolist() == [IGNORE] * len(prompt) + call + [IGNORE] * len(result) + answer
    short = tok("1+2+3=")["input_ids"] + tok("6", add_special_tokens=False)["input_ids"] + [eos]
    assert input_ids[1].tolist() == short + [tok.pad_token_id] * (len(sequence) - len(short))
    assert labels[1].tolist()[len(short) - 2 : len(short)] == short[-2:] and labels[1, 0] == IGNORE
