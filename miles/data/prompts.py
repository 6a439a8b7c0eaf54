"""PromptFormatter: a row's prompt, a string or chat messages, as the text the model is given and its token ids.

Chat messages (`[{"role": ..., "content": ...}, ...]`, the Hugging Face conversational format) always go through
the model's own chat template, `tokenizer.apply_chat_template(messages, add_generation_prompt=True)`; a string
does when `data.apply_chat_template` is true, as one user message. `data.system_prompt` then comes first, unless
the messages start with their own. A templated prompt is tokenized without adding special tokens (the template
has them), so its ids are exactly those `apply_chat_template(..., tokenize=True)` gives; a plain string is
tokenized as the tokenizer does by default.
"""

from __future__ import annotations

from miles.config import DataConfig

Prompt = str | list[dict[str, str]]


class PromptFormatter:
    def __init__(self, tokenizer, data: DataConfig):
        self.tokenizer = tokenizer
        self.data = data

    def templated(self, prompt: Prompt) -> bool:
        return isinstance(prompt, list) or bool(self.data.apply_chat_template)

    def text(self, prompt: Prompt) -> str:
        if not self.templated(prompt):
            return prompt
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if self.data.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.data.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, prompts: list[Prompt]) -> tuple[list[str], list[list[int]]]:
        """The texts the model is given and their token ids."""
        texts = [self.text(p) for p in prompts]
        ids: list[list[int]] = [[] for _ in prompts]
        for templated in (True, False):  # one tokenizer call per kind, not per prompt
            rows = [i for i, p in enumerate(prompts) if self.templated(p) == templated]
            if rows:
                encoded = self.tokenizer([texts[i] for i in rows], add_special_tokens=not templated)["input_ids"]
                for i, row_ids in zip(rows, encoded, strict=True):
                    ids[i] = row_ids
        return texts, ids

    def check(self, prompts: list[Prompt], model: str) -> None:
        """Refuse, before any work, prompts that need a chat template the tokenizer does not have, and a system
        prompt that no prompt would carry."""
        templated = [i for i, p in enumerate(prompts, start=1) if self.templated(p)]
        if templated and not getattr(self.tokenizer, "chat_template", None):
            why = (
                f"row {templated[0]} holds chat messages"
                if isinstance(prompts[templated[0] - 1], list)
                else "data.apply_chat_template is true"
            )
            raise ValueError(
                f"{why}, but the tokenizer of {model} has no chat template (its tokenizer_config.json or "
                "chat_template.jinja sets none): use an instruct model's tokenizer, or plain string prompts with "
                "data.apply_chat_template=false"
            )
        if self.data.system_prompt is not None and not templated:
            raise ValueError(
                "data.system_prompt goes into the chat template, which no prompt goes through: set "
                "data.apply_chat_template=true for string prompts"
            )
