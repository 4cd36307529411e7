"""Hermes-style calls (Qwen2.5, Qwen3, Hermes, SmolLM2's tool template): each call is a JSON
object ``{"name", "arguments"}`` between ``<tool_call>`` and ``</tool_call>``."""

from __future__ import annotations

from typing import Any

from pagoda.parsers import MarkedToolParser, ToolCall
from pagoda_tool_parsers.calls import calls_of, triggered_tags


class HermesToolParser(MarkedToolParser):
    call_start = "<tool_call>"
    call_end = "</tool_call>"

    def parse_block(self, block: str) -> list[ToolCall] | None:
        calls = calls_of(block)
        return calls if calls is not None and len(calls) == 1 else None

    def structural_tag(self) -> dict[str, Any] | None:
        tags = [
            {
                "type": "tag",
                "begin": f'<tool_call>\n{{"name": "{t["function"]["name"]}", "arguments": ',
                "content": {
                    "type": "json_schema",
                    "json_schema": self.schema(t["function"]["name"]),
                },
                "end": "}\n</tool_call>",
            }
            for t in self.tools
        ]
        return triggered_tags(self.call_start, tags)
