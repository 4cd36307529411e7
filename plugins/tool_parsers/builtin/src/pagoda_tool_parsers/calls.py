"""JSON call objects, as most formats write them: ``{"name": ..., "arguments": {...}}``."""

from __future__ import annotations

import json
from typing import Any

from pagoda.parsers import ToolCall


def call_of(value: Any) -> ToolCall | None:
    """The call a decoded JSON value describes (``arguments`` or Llama's ``parameters``, an
    object or its JSON text), or None if it describes none."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args, strict=False)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


def calls_of(text: str, separators: str = "") -> list[ToolCall] | None:
    """Every call in ``text``: JSON objects or arrays of them, one after another, apart by
    whitespace or ``separators``; None if anything else is there."""
    # NOTE: strict=False takes control characters inside strings, which byte-level tokens can
    # write even under a JSON grammar; the arguments are dumped again, escaped.
    decoder = json.JSONDecoder(strict=False)
    calls: list[ToolCall] = []
    pos, skip = 0, " \t\r\n" + separators
    while True:
        while pos < len(text) and text[pos] in skip:
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        for item in value if isinstance(value, list) else [value]:
            call = call_of(item)
            if call is None:
                return None
            calls.append(call)


def triggered_tags(trigger: str, tags: list[dict[str, Any]]) -> dict[str, Any]:
    """An xgrammar structural tag: free text until ``trigger``, then one of ``tags`` (each a
    ``{"type": "tag", "begin", "content", "end"}``), then free text again."""
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": [trigger], "tags": tags},
    }
