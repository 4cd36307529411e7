"""Variable-length per-row lists (allowed ids, logit bias, stop ids, bad words) kept in padded
arrays that widen on demand, so the lists of all the rows of a step come out of one gather."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class RaggedRows:
    """Per row a short list of token ids (and, optionally, one float per id); padding is -1."""

    def __init__(self, num_rows: int, with_values: bool = False) -> None:
        self.ids = np.full((num_rows, 0), -1, dtype=np.int64)
        self.values = np.zeros((num_rows, 0), dtype=np.float32) if with_values else None
        self.has = np.zeros(num_rows, dtype=bool)

    def set(self, row: int, ids: Sequence[int], values: Sequence[float] = ()) -> None:
        n = len(ids)
        grow = n - self.ids.shape[1]
        if grow > 0:
            self.ids = np.pad(self.ids, ((0, 0), (0, grow)), constant_values=-1)
            if self.values is not None:
                self.values = np.pad(self.values, ((0, 0), (0, grow)))
        self.ids[row] = -1
        self.ids[row, :n] = ids
        if self.values is not None:
            self.values[row, :n] = values
        self.has[row] = n > 0

    def pairs(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Every entry of the given rows: (index into ``rows``, token id, value or None)."""
        sub = self.ids[rows]
        idx, col = np.nonzero(sub >= 0)
        values = None if self.values is None else self.values[rows[idx], col]
        return idx, sub[idx, col], values


class BadWords:
    """Per row its bad words as token sequences, right-aligned in [rows, words, longest]."""

    def __init__(self, num_rows: int) -> None:
        self.words = np.full((num_rows, 0, 0), -1, dtype=np.int64)
        self.has = np.zeros(num_rows, dtype=bool)

    def set(self, row: int, words: Sequence[Sequence[int]]) -> None:
        longest = max((len(w) for w in words), default=0)
        more_words = len(words) - self.words.shape[1]
        longer = longest - self.words.shape[2]
        if more_words > 0 or longer > 0:
            pad = ((0, 0), (0, max(more_words, 0)), (max(longer, 0), 0))
            self.words = np.pad(self.words, pad, constant_values=-1)
        self.words[row] = -1
        width = self.words.shape[2]
        for i, word in enumerate(words):
            self.words[row, i, width - len(word) :] = word
        self.has[row] = bool(words)

    def banned(
        self,
        rows: np.ndarray,
        token_ids: np.ndarray,
        n_tok: np.ndarray,
        n_prompt: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(index into ``rows``, token id): the last token of each bad word whose other tokens
        are the last tokens of the row's output (vLLM looks at the output only). ``n_tok`` and
        ``n_prompt`` are each row's token and prompt counts, aligned with ``rows``."""
        words = self.words[rows]
        width = words.shape[2]
        pos = (n_tok - (width - 1))[:, None] + np.arange(width - 1)
        history = token_ids[rows[:, None], np.maximum(pos, 0)]
        history[pos < n_prompt[:, None]] = -2  # not output: matches no word
        prefix = words[:, :, :-1]
        match = ((prefix == -1) | (prefix == history[:, None, :])).all(axis=-1)
        idx, word = np.nonzero(match & (words[:, :, -1] >= 0))
        return idx, words[idx, word, -1]
