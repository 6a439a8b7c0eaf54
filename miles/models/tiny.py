"""Build the tiny model (Llama architecture) and tokenizer, warm them up with SFT, and cache the result on disk.

The cache key hashes everything that shapes the weights (model shape, warm-up settings, tasks, seed), so a
second run reuses the directory and a changed setting builds a new one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from miles.config import ModelConfig

log = logging.getLogger(__name__)

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARACTERS = "0123456789+-="
# Part of the cache key: bump when the build or warm-up code changes what it produces.
_BUILD_VERSION = "tiny-llama-v1"


def build_tokenizer(tool_tokens: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """One token per character; the post-processor prepends BOS so `tok("1+2=")` gives the model's prompt ids.
    `tool_tokens` (a tool environment's markup, e.g. `<calc>`) are one token each, after the characters."""
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    vocab.update({ch: i + 3 for i, ch in enumerate(CHARACTERS)})
    vocab.update({token: len(vocab) + i for i, token in enumerate(tool_tokens)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    # Matched before the per-character split, and kept when decoding (they are not special).
    tok.add_tokens([AddedToken(token, normalized=False, special=False) for token in tool_tokens])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left"
    )


def tool_tokens(tasks: Sequence[str]) -> tuple[str, ...]:
    """The tokens the tasks' tools need: the calculator's markup for the sums task."""
    from miles.envs.arithmetic import SUMS
    from miles.envs.calculator import TOOL_TOKENS

    return TOOL_TOKENS if SUMS in tasks else ()


def build_tiny_model(config: ModelConfig, vocab_size: int, seed: int) -> LlamaForCausalLM:
    shape = config.tiny
    torch.manual_seed(seed)
    hf_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(hf_config)


def _cache_key(config: ModelConfig, tasks: Sequence[str], seed: int) -> str:
    blob = json.dumps(
        {
            "v": _BUILD_VERSION,
            "tiny": config.tiny.model_dump(),
            "warmup": config.warmup.model_dump(),
            "tasks": list(tasks),
            "seed": seed,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_root() -> Path:
    return Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles-flow"))


def ensure_embedded_model(config: ModelConfig, tasks: Sequence[str], seed: int, cache_root: Path | None = None) -> Path:
    """Return the directory of the embedded model warmed up on the built-in `tasks`, built once per setting."""
    tasks = sorted(set(tasks))
    root = cache_root or default_cache_root()
    target = root / f"tiny-{'-'.join(tasks)}-{_cache_key(config, tasks, seed)}"
    if (target / "warmup.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # One build per model on this machine: a run starting while another builds the same model waits for it.
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "warmup.json").exists():
            _build(target, config, tasks, seed)
    return target


def _build(target: Path, config: ModelConfig, tasks: list[str], seed: int) -> None:
    from miles.models.warmup import warm_up

    tokenizer = build_tokenizer(tool_tokens(tasks))
    model = build_tiny_model(config, len(tokenizer), seed)
    report = warm_up(model, tokenizer, tasks, config.warmup, seed)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "warmup.json").write_text(json.dumps(report, indent=2))
        try:
            os.replace(staging, target)
        except OSError:
            # Another host sharing this cache (a network file system, where the lock may not hold) built it first.
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("embedded model ready at %s (warm-up greedy accuracy %.3f)", target, report["greedy_accuracy"])
