"""Engine logprobs (per position: token id -> ``Logprob``) in OpenAI's two formats."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pagoda.outputs import Logprob, PositionLogprobs

TokenText = Callable[[int], str]


def _text(token_id: int, lp: Logprob, token_text: TokenText) -> str:
    return lp.decoded_token if lp.decoded_token is not None else token_text(token_id)


def _value(x: float) -> float:
    return max(x, -9999.0) if not math.isnan(x) else -9999.0  # JSON has no -inf


def _by_rank(position: PositionLogprobs) -> list[tuple[int, Logprob]]:
    return sorted(position.items(), key=lambda kv: kv[1].rank or math.inf)


class CompletionLogprobs:
    """The completions format, built incrementally (a stream sends it in pieces):
    ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``. ``top_logprobs`` holds the
    top k and the chosen token, as OpenAI's legacy API does."""

    def __init__(self, token_text: TokenText, text_offset: int = 0) -> None:
        self.token_text = token_text
        self.offset = text_offset

    def format(
        self,
        token_ids: Sequence[int],
        positions: Sequence[PositionLogprobs | None],
    ) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, position in zip(token_ids, positions):
            chosen = position.get(token_id) if position is not None else None
            text = (
                _text(token_id, chosen, self.token_text)
                if chosen is not None
                else self.token_text(token_id)
            )
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if position is None or chosen is None:  # the first prompt token has none
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(_value(chosen.logprob))
            top.append(
                {_text(t, lp, self.token_text): _value(lp.logprob) for t, lp in _by_rank(position)}
            )
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }


def chat_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs],
    num_top: int,
    token_text: TokenText,
) -> dict[str, Any]:
    """The chat format: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` with
    exactly the ``num_top`` most likely tokens in each ``top_logprobs``."""

    def entry(token_id: int, lp: Logprob) -> dict[str, Any]:
        text = _text(token_id, lp, token_text)
        return {"token": text, "logprob": _value(lp.logprob), "bytes": list(text.encode())}

    content = []
    for token_id, position in zip(token_ids, positions):
        item = entry(token_id, position[token_id])
        item["top_logprobs"] = [entry(t, lp) for t, lp in _by_rank(position)[:num_top]]
        content.append(item)
    return {"content": content}
