"""Qwen3-Coder's XML calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's text is a string where the tool's schema says so (or names no type); otherwise it
is read as JSON (numbers, booleans, objects), and kept as a string if it is not JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagoda.parsers import MarkedToolParser, ToolCall
from pagoda_tool_parsers.calls import triggered_tags

_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class Qwen3CoderToolParser(MarkedToolParser):
    call_start = "<tool_call>"
    call_end = "</tool_call>"

    def parse_block(self, block: str) -> list[ToolCall] | None:
        m = _FUNCTION.match(block)
        if m is None:
            return None
        name, body = m.group(1).strip(), m.group(2)
        properties = self.schema(name).get("properties") or {}
        args: dict[str, Any] = {}
        for key, raw in _PARAMETER.findall(body):
            key = key.strip()
            args[key] = _value(raw.removeprefix("\n").removesuffix("\n"), properties.get(key))
        if _PARAMETER.sub("", body).strip():
            return None  # text outside the parameters: not a call this parser understands
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))]

    def structural_tag(self) -> dict[str, Any] | None:
        tags = [
            {
                "type": "tag",
                "begin": f"<tool_call>\n<function={t['function']['name']}>\n",
                "content": {
                    "type": "json_schema",
                    "json_schema": self.schema(t["function"]["name"]),
                    "style": "qwen_xml",
                },
                "end": "</function>\n</tool_call>",
            }
            for t in self.tools
        ]
        return triggered_tags(self.call_start, tags)


def _value(text: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
