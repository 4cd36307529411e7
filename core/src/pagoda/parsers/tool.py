"""The tool-call parser contract: a model's output text -> content and tool calls, whole or
streamed.

A parser is built per request with the request's tools (OpenAI's ``tools`` entries, as dicts).
:meth:`ToolParser.parse` reads a finished output; :meth:`ToolParser.feed` reads a stream one delta
at a time and :meth:`ToolParser.finish` flushes it. The streamed deltas concatenate to what
``parse`` returns for the whole text: the same content, the same calls in the same order (a
call's ``arguments`` may arrive in pieces, concatenated by ``index``).

Most formats wrap each call (or a list of calls) between markers; :class:`MarkedToolParser`
does the segmentation and the streaming for them, so that a format only says how one block of
text becomes calls. A block that does not parse is content, verbatim: a malformed call is never
dropped.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagoda.plugins.manager import get_registry


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text

    def openai(self, call_id: str | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry of this call."""
        return {
            "id": call_id or new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedToolCalls:
    """A finished output: its content (None when it is only whitespace) and its calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """A piece of one call in a stream: ``id`` and ``name`` come with its first piece."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass
class ToolStreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser(ABC):
    """Finds tool calls in a model's output; registered through ``register_tool_parsers``.

    ``tools`` are the request's tools (``[{"type": "function", "function": {"name", ...}}]``).
    One instance serves one output: ``parse`` once, or ``feed`` then ``finish``.
    """

    #: The text that starts a call, if the format has one; the server's tool-call grammar
    #: (xgrammar structural tags) triggers on it.
    call_start: ClassVar[str | None] = None
    #: The format's markers are special tokens (Mistral's ``[TOOL_CALLS]``): the server then
    #: decodes the output with ``skip_special_tokens`` false, so that the parser sees them.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.tools = tools

    @abstractmethod
    def parse(self, text: str) -> ParsedToolCalls:
        """The content and calls of a finished output."""

    @abstractmethod
    def feed(self, delta: str) -> ToolStreamDelta:
        """Read the next piece of a streamed output; return what can be sent now."""

    @abstractmethod
    def finish(self) -> ToolStreamDelta:
        """The stream has ended: return what was held back."""

    def structural_tag(self) -> dict[str, Any] | None:
        """An xgrammar structural tag that constrains each call to a declared tool's schema
        once it starts (free text elsewhere), or None if the format has none."""
        return None

    def schema(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object", "properties": {}}
        return {"type": "object"}


class MarkedToolParser(ToolParser):
    """A format whose calls sit in blocks that start with :attr:`call_start` and end with
    :attr:`call_end` (None: the block runs to the end of the output). Subclasses implement
    :meth:`parse_block`."""

    call_start: ClassVar[str]
    call_end: ClassVar[str | None] = None

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._text = ""
        self._sent_content = 0  # characters of content sent
        self._sent_calls = 0

    @abstractmethod
    def parse_block(self, block: str) -> list[ToolCall] | None:
        """The calls in the text between a start and an end marker, or None if it is malformed
        (the block is then content)."""

    def find_start(self, text: str, pos: int) -> tuple[int, int] | None:
        """Where the next block at or after ``pos`` starts and where its body starts."""
        i = text.find(self.call_start, pos)
        return None if i < 0 else (i, i + len(self.call_start))

    def held(self, tail: str) -> int:
        """How many characters at the end of ``tail`` (content so far) may be the beginning of
        a start marker, and so are held back from a stream."""
        for n in range(min(len(tail), len(self.call_start) - 1), 0, -1):
            if self.call_start.startswith(tail[-n:]):
                return n
        return 0

    def _split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while pos <= len(text):
            found = self.find_start(text, pos)
            if found is None:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - self.held(tail)]
                content.append(tail)
                break
            begin, body = found
            content.append(text[pos:begin])
            end = -1 if self.call_end is None else text.find(self.call_end, body)
            if end < 0:
                if not final:
                    break
                block, after = text[body:], len(text)
            else:
                block, after = text[body:end], end + len(self.call_end or "")
            parsed = self.parse_block(block)
            if parsed is None:
                content.append(text[begin:after])
            else:
                calls.extend(parsed)
            if after == pos:  # an empty marker at the end: nothing more to read
                break
            pos = after
        return "".join(content), calls

    def parse(self, text: str) -> ParsedToolCalls:
        content, calls = self._split(text, final=True)
        return ParsedToolCalls(content if content.strip() else None, calls)

    def _delta(self, final: bool) -> ToolStreamDelta:
        content, calls = self._split(self._text, final)
        out = ToolStreamDelta()
        # Whitespace alone is held: an output of calls only has no content at all.
        if content.strip():
            out.content = content[self._sent_content :]
            self._sent_content = len(content)
        for i in range(self._sent_calls, len(calls)):
            call = calls[i]
            out.tool_calls.append(ToolCallDelta(i, call.arguments, new_call_id(), call.name))
        self._sent_calls = len(calls)
        return out

    def feed(self, delta: str) -> ToolStreamDelta:
        self._text += delta
        return self._delta(final=False)

    def finish(self) -> ToolStreamDelta:
        return self._delta(final=True)


def tool_parser_class(name: str) -> type[ToolParser]:
    """The tool parser registered as ``name``; an error naming the available ones if none is."""
    return get_registry("tool_parsers").get(name)
