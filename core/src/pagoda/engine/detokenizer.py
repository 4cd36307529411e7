"""Incremental detokenization: text grows token by token, never with half a character."""

from __future__ import annotations

import contextlib
from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers without incremental decoding (before 0.21)
    DecodeStream = None

# Prompt tokens kept as left context, so the first output token decodes with the right spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decodes a small window that ends at the newest token and emits only the new, complete text.

    With a fast (Rust) tokenizer the window lives in ``tokenizers``' ``DecodeStream``: one call per
    token instead of two decodes of the window (about 1 us a token against 8 for SmolLM2's), which
    matters at hundreds of tokens a step. Other tokenizers, or a stream that fails, use the window
    in Python.

    NOTE: a byte-level token may hold part of a UTF-8 character; the window then decodes to text
    ending in U+FFFD, and the delta waits until the next tokens complete the character.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._fast = getattr(tokenizer, "_tokenizer", None) if DecodeStream is not None else None
        self._stream = None
        if self._fast is not None:
            # NOTE: tokenizers before 0.22 cannot start a stream from context ids (TypeError).
            with contextlib.suppress(TypeError):
                self._stream = DecodeStream(ids=self.ids, skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        if self._stream is not None:
            try:
                text = self._stream.step(self._fast, token_id)
            except Exception:  # the Python window takes over from the last tokens seen
                self._stream = None
                self.prefix_offset = max(0, len(self.ids) - _CONTEXT_TOKENS)
                self.read_offset = len(self.ids)
            else:
                self.ids.append(token_id)
                return text or ""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]


class TokenTexts:
    """The text of single tokens (logprobs' ``decoded_token``), decoded once per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


def find_stop_string(
    text: str, new_len: int, stops: list[str], include: bool
) -> tuple[str, int] | None:
    """Look for a stop string in the last ``new_len`` characters of ``text`` (and the few before
    them that a stop string could straddle). Returns (stop string, where to cut the text)."""
    found: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, len(text) - new_len - len(stop) + 1))
        if idx != -1 and (found is None or idx < found[0]):
            found = (idx, stop)
    if found is None:
        return None
    idx, stop = found
    return stop, idx + len(stop) if include else idx
