"""The training corpus: the standard library's docstrings and code, read without importing it;
held-out messages never share a text with training ones."""

from __future__ import annotations

import subprocess
import sys

from pagoda_spec_eagle.record import _ASKS, HELD_OUT_TEXTS, _texts, corpus


def _text_of(message: str) -> str:
    for ask in _ASKS:
        head, tail = ask.split("{}")
        if message.startswith(head) and message.endswith(tail):
            return message[len(head) : len(message) - len(tail)]
    raise AssertionError(f"no instruction matches {message[:80]!r}")


def test_held_out_messages_share_no_text_with_training_ones() -> None:
    train = {_text_of(m) for m in corpus(4000, seed=2)}
    held = {_text_of(m) for m in corpus(HELD_OUT_TEXTS, seed=2, heldout=True)}
    assert len(held) == HELD_OUT_TEXTS and len(train) > 2000
    assert not train & held
    assert corpus(50, seed=2) == corpus(50, seed=2) != corpus(50, seed=3)


def test_texts_are_parsed_from_the_library_without_running_it() -> None:
    texts = _texts()
    assert len(texts) > 3000  # every module's documentation and code, not a chosen few
    assert any(t.startswith("json: ") for t in texts)  # a package's docstring, under its name
    assert any(t.startswith("def ") for t in texts)  # code of a function without a docstring
    # Importing some modules does things (``antigravity`` opens a browser, ``this`` prints):
    # reading the texts imports none of them.
    code = (
        "import sys; from pagoda_spec_eagle.record import _texts; before = set(sys.modules); "
        "_texts(); print(sorted(m for m in set(sys.modules) - before if m in "
        "('antigravity', 'this', 'json', 'tkinter', 'smtplib')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
