"""Incremental detokenization never emits half a character, and adds up to the full decode."""

from __future__ import annotations

import pytest

from pagoda.engine.detokenizer import IncrementalDetokenizer, find_stop_string

TEXTS = [
    "Hello, world! Ünïcödé façade — naïve café.",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji: 🙂🚀👩‍👩‍👧 and a flag 🇫🇷 done.",
    "  leading spaces, tabs\tand\nnew lines  ",
]


class _PythonOnly:
    """The tokenizer without its Rust core, so the detokenizer decodes its window in Python."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("path", ["stream", "python"])
def test_deltas_are_whole_characters_and_sum_to_the_decode(smollm2_tokenizer, path) -> None:
    tok = smollm2_tokenizer
    prompt = tok.encode("Say something:")
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(
            tok if path == "stream" else _PythonOnly(tok), prompt, skip_special_tokens=True
        )
        assert (detok._stream is not None) == (path == "stream")
        deltas = [detok.add_token(t) for t in ids]
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    # Multi-byte characters really were split across tokens somewhere above.
    ids = tok.encode(TEXTS[2], add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids)


def test_a_stream_that_fails_hands_over_to_the_python_window(smollm2_tokenizer) -> None:
    class Broken:
        def step(self, tokenizer, token_id):
            raise RuntimeError("invalid prefix")

    tok = smollm2_tokenizer
    ids = tok.encode(TEXTS[0] + " " + TEXTS[2], add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"), skip_special_tokens=True)
    deltas = [detok.add_token(t) for t in ids[:4]]  # whole words so far
    detok._stream = Broken()
    deltas += [detok.add_token(t) for t in ids[4:]]
    assert detok._stream is None
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped_or_kept_on_request(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("Hi", add_special_tokens=False) + [tok.eos_token_id]
    skip = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(skip.add_token(t) for t in ids) == "Hi"
    assert "".join(keep.add_token(t) for t in ids) == "Hi" + tok.eos_token


def test_find_stop_string_finds_the_earliest_and_straddling_stops() -> None:
    assert find_stop_string("abc STOP def", 4, ["STOP"], include=False) is None
    assert find_stop_string("abc STOP", 2, ["STOP"], include=False) == ("STOP", 4)
    assert find_stop_string("abc STOP", 2, ["STOP"], include=True) == ("STOP", 8)
    assert find_stop_string("x END y STOP", 12, ["STOP", "END"], include=False) == ("END", 2)
