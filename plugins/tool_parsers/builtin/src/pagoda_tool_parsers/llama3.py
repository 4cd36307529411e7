"""Llama 3.1/3.2 JSON calls: the output is ``{"name", "parameters"}`` objects (apart by ``;``),
at its very start or after ``<|python_tag|>``."""

from __future__ import annotations

from pagoda.parsers import MarkedToolParser, ToolCall
from pagoda_tool_parsers.calls import calls_of


class Llama3JsonToolParser(MarkedToolParser):
    call_start = "<|python_tag|>"
    call_end = None

    def find_start(self, text: str, pos: int) -> tuple[int, int] | None:
        if pos == 0 and text.lstrip().startswith("{"):
            i = text.index("{")
            return i, i
        return super().find_start(text, pos)

    def held(self, tail: str) -> int:
        # An output of whitespace so far may still open with a call.
        return len(tail) if not tail.strip() else super().held(tail)

    def parse_block(self, block: str) -> list[ToolCall] | None:
        return calls_of(block, separators=";")
