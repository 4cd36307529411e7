"""A chat choice's output through the server's reasoning and tool-call parsers: the reasoning
goes to ``reasoning_content``, the rest to the tool parser (``tool_choice: auto``), whose calls
become ``tool_calls``; whole (:meth:`ChoiceParser.message`) or streamed as deltas."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagoda.config import ServerConfig
from pagoda.entrypoints.openai.structured import ToolCallPlan
from pagoda.parsers import (
    ReasoningParser,
    ToolParser,
    reasoning_parser_class,
    tool_parser_class,
)
from pagoda.plugins import PluginError
from pagoda.sampling_params import StructuredOutputsParams


@dataclass
class ServerParsers:
    """The parser classes the server was started with (``server.tool_call_parser``,
    ``server.reasoning_parser``), looked up once."""

    tool: type[ToolParser] | None
    reasoning: type[ReasoningParser] | None
    auto_tools: bool
    grammar: bool

    @classmethod
    def of(cls, server: ServerConfig) -> ServerParsers:
        """Raises ``ValueError`` (an unknown name lists the available ones) for a bad setting."""
        if server.enable_auto_tool_choice and server.tool_call_parser is None:
            raise ValueError(
                "server.enable_auto_tool_choice needs server.tool_call_parser "
                "(--tool-call-parser NAME)"
            )
        if server.tool_call_grammar and not server.enable_auto_tool_choice:
            raise ValueError("server.tool_call_grammar needs server.enable_auto_tool_choice")
        try:
            tool = tool_parser_class(server.tool_call_parser) if server.tool_call_parser else None
            reasoning = (
                reasoning_parser_class(server.reasoning_parser) if server.reasoning_parser else None
            )
        except PluginError as e:  # an unknown name's error lists the available ones
            raise ValueError(str(e)) from None
        return cls(tool, reasoning, server.enable_auto_tool_choice, server.tool_call_grammar)

    def check(self, plan: ToolCallPlan | None) -> None:
        """A 400's ``ValueError`` if the request asks for what the server does not serve."""
        if plan is not None and plan.auto and not self.auto_tools:
            raise ValueError(
                "`tool_choice` auto (the default when `tools` are given) is not supported by "
                "this server as started (it needs --enable-auto-tool-choice --tool-call-parser "
                "NAME); set `tool_choice` to `required` or name a function"
            )

    def constraint(self, plan: ToolCallPlan | None) -> StructuredOutputsParams | None:
        """The tool-call grammar of an ``auto`` request, if the server holds calls to their
        schemas."""
        if plan is None or not plan.auto or not self.grammar or self.tool is None:
            return None
        tag = self.tool(_tools(plan)).structural_tag()
        if tag is None:
            return None
        if not plan.parallel:
            tag = {**tag, "format": {**tag["format"], "stop_after_first": True}}
        return StructuredOutputsParams(structural_tag=json.dumps(tag, ensure_ascii=False))

    def keeps_special_tokens(self, plan: ToolCallPlan | None) -> bool:
        """Whether an ``auto`` request's output must keep special tokens for the parser."""
        auto = plan is not None and plan.auto
        return auto and self.tool is not None and self.tool.keeps_special_tokens

    def choice(self, plan: ToolCallPlan | None) -> ChoiceParser | None:
        """A parser for one choice, or None when its text is all content."""
        tools = plan is not None and plan.auto and self.tool is not None
        if not tools and self.reasoning is None:
            return None
        if plan is not None and not plan.auto:
            return None  # a forced call: the grammar made it JSON from the first token
        return ChoiceParser(
            self.tool(_tools(plan)) if tools else None,  # type: ignore[misc,arg-type]
            self.reasoning() if self.reasoning is not None else None,
            plan is None or plan.parallel,
        )


def _tools(plan: ToolCallPlan | None) -> list[dict[str, Any]]:
    return [] if plan is None else [t.model_dump(exclude_none=True) for t in plan.tools]


class ChoiceParser:
    """One choice's parsers; ``parallel`` false keeps only the first call."""

    def __init__(
        self, tool: ToolParser | None, reasoning: ReasoningParser | None, parallel: bool
    ) -> None:
        self.tool = tool
        self.reasoning = reasoning
        self.parallel = parallel
        self.called = False  # a call was sent: the stream's finish_reason is tool_calls

    def message(self, text: str) -> dict[str, Any]:
        """The ``message`` of a finished choice."""
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.parse(text)
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if self.tool is not None:
            parsed = self.tool.parse(content or "")
            calls = parsed.tool_calls if self.parallel else parsed.tool_calls[:1]
            out["content"] = parsed.content
            if calls:
                out["tool_calls"] = [c.openai() for c in calls]
                self.called = True
        return out

    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        """The ``delta`` for the next piece of a stream (empty: nothing to send yet); ``final``:
        the stream ends with this piece, so nothing is held back."""
        if self.reasoning is None:
            return self._content(text, final)
        d = self.reasoning.feed(text)
        if final:
            end = self.reasoning.finish()
            d.reasoning += end.reasoning
            d.content += end.content
        return self._merge(d.reasoning, self._content(d.content, final))

    @staticmethod
    def _merge(reasoning: str, delta: dict[str, Any]) -> dict[str, Any]:
        return {"reasoning_content": reasoning, **delta} if reasoning else delta

    def _content(self, text: str, final: bool) -> dict[str, Any]:
        if self.tool is None:
            return {"content": text} if text else {}
        d = self.tool.feed(text)
        if final:
            end = self.tool.finish()
            d.content += end.content
            d.tool_calls += end.tool_calls
        out: dict[str, Any] = {"content": d.content} if d.content else {}
        calls = [c for c in d.tool_calls if self.parallel or c.index == 0]
        if calls:
            out["tool_calls"] = [c.openai() for c in calls]
            self.called = True
        return out
