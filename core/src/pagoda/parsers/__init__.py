"""Output parsers of chat completions (features floor): tool-call parsers find tool calls in a
model's free text (``tool_choice: auto``), reasoning parsers split off its thinking
(``reasoning_content``). Each is a contract here, registered by name through a hook
(``register_tool_parsers``, ``register_reasoning_parsers``); the built-ins live in the
``pagoda-tool-parsers`` plugin."""

from __future__ import annotations

from pagoda.parsers.reasoning import (
    ReasoningDelta,
    ReasoningParser,
    ThinkTagsParser,
    reasoning_parser_class,
)
from pagoda.parsers.tool import (
    MarkedToolParser,
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamDelta,
    tool_parser_class,
)

__all__ = [
    "MarkedToolParser",
    "ParsedToolCalls",
    "ReasoningDelta",
    "ReasoningParser",
    "ThinkTagsParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamDelta",
    "reasoning_parser_class",
    "tool_parser_class",
]
