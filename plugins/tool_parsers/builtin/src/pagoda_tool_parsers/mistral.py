"""Mistral calls after ``[TOOL_CALLS]``: a JSON array of ``{"name", "arguments"}`` objects, or
(tokenizer v11 and later) ``name[ARGS]{...}``, one per ``[TOOL_CALLS]``. The marker is a special
token, kept in the text (``keeps_special_tokens``)."""

from __future__ import annotations

import json

from pagoda.parsers import MarkedToolParser, ToolCall
from pagoda_tool_parsers.calls import calls_of


class MistralToolParser(MarkedToolParser):
    call_start = "[TOOL_CALLS]"
    call_end = None
    keeps_special_tokens = True

    def parse_block(self, block: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for part in block.split(self.call_start):
            if part.lstrip().startswith(("[", "{")):
                found = calls_of(part)
            else:
                found = _named_call(part)
            if found is None:
                return None
            calls.extend(found)
        return calls or None


def _named_call(part: str) -> list[ToolCall] | None:
    name, sep, args = part.partition("[ARGS]")
    if not sep or not name.strip():
        return None
    try:
        value = json.loads(args)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return [ToolCall(name.strip(), json.dumps(value, ensure_ascii=False))]
