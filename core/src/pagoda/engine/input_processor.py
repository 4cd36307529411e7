"""Turns user prompts into token ids the core can run, and rejects what it cannot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.model_info import ModelInfo

PromptType = str | dict[str, Any]


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class InputProcessor:
    def __init__(self, tokenizer: Any, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    def process(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            ids = self.tokenizer.encode(text)
        else:
            raise TypeError(
                "a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}; got "
                f"{type(prompt).__name__}"
            )
        self.validate(ids)
        return ProcessedPrompt(text, ids)

    def validate(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.info.shape.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        limit = self.info.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the model's context is {limit} "
                "(max_model_len), which must also leave room for one output token"
            )
