"""A model directory like a pretrained instruct model's, built in the test: a byte-level BPE vocabulary of 32k+ tokens
trained with `tokenizers`, ChatML special tokens and template, <|im_end|> and <|endoftext|> as end-of-sequence ids in
generation_config.json (as Qwen2.5-Instruct ships them), a Llama of two layers with tied embeddings, stored in
bfloat16, taught briefly to answer GSM8K-style questions as '#### <number><|im_end|>'."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tests.helpers.chat import CHATML

VOCAB_SIZE = 32768
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "what is the sum of and plus minus times how many apples does she have left if he buys more each day total "
    "answer solve problem step by first then number cost dollars"
).split()


def questions(count: int, seed: int = 0) -> list[tuple[str, int]]:
    """GSM8K-style questions with their answers: 'What is a plus b?' -> a + b."""
    rng = random.Random(seed)
    pairs = [(rng.randrange(1, 50), rng.randrange(1, 50)) for _ in range(count)]
    return [(f"What is {a} plus {b}?", a + b) for a, b in pairs]


def write_gsm8k_data(path: Path, count: int, seed: int = 0) -> Path:
    """JSONL rows as a chat data set: `messages` (one user turn) and GSM8K's `answer` field ('... #### 72')."""
    rows = [
        {"messages": [{"role": "user", "content": q}], "answer": f"The sum is {a}.\n#### {a}"}
        for q, a in questions(count, seed)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def chat_data_overrides(model_dir: Path, data: Path) -> list[str]:
    """A run of `model_dir` on the chat data set `write_gsm8k_data` wrote, scored by the gsm8k reward."""
    return [
        f"model.path={model_dir}",
        "data.task=null",
        f"data.path={data}",
        "data.prompt_key=messages",
        "data.label_key=answer",
        "data.reward=gsm8k",
    ]


def _corpus(rng: random.Random) -> list[str]:
    """Text with enough distinct pairs for 32k merges: pseudo-words over a-z, each repeated, plus the words and
    numbers the questions use."""
    pseudo = ["".join(rng.choices(string.ascii_lowercase, k=rng.randrange(3, 9))) for _ in range(60000)]
    numbers = [str(n) for n in range(200)]
    lines = [" ".join(pseudo[i : i + 12]) for i in range(0, len(pseudo), 12)]
    return lines * 2 + [" ".join(WORDS + numbers + ["####"])] * 50


def build_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(random.Random(seed)), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def _teach(model: LlamaForCausalLM, tokenizer, steps: int, seed: int) -> None:
    """A few steps of supervised training on whole ChatML exchanges, so that sampling ends answers at <|im_end|>."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": f"#### {a}"}], tokenize=False
        )
        for q, a in questions(256, seed + 1)
    ]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, ids))
    tokens = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    labels = tokens.masked_fill(attention == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        rows = slice((step * 64) % len(ids), (step * 64) % len(ids) + 64)
        loss = model(input_ids=tokens[rows], attention_mask=attention[rows], labels=labels[rows]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def build_instruct_model(directory: Path, seed: int = 0, teach_steps: int = 60) -> Path:
    tokenizer = build_tokenizer(seed)
    im_end, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=end_of_text,
    )
    model = LlamaForCausalLM(config)
    _teach(model, tokenizer, teach_steps, seed)
    model.generation_config = GenerationConfig(eos_token_id=[im_end, end_of_text], pad_token_id=end_of_text)
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
