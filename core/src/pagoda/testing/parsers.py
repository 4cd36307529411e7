"""The conformance kit for tool-call and reasoning parsers.

A tool parser's format is described by a :class:`ToolFormat` (how it writes calls); the kit
builds a table of outputs and the content and calls any parser must find in them (absent,
single, parallel, content before and after, malformed, cut short, a stray ``<``), and checks
each one whole and streamed in pieces of several sizes, the streamed deltas concatenating to
the whole result::

    from pagoda.testing.parsers import ToolFormat, check_tool_parser

    def test_my_format_conforms():
        check_tool_parser(MyToolParser, ToolFormat(write=my_write, content_after=True))

A reasoning parser is checked against a table of (output, reasoning, content) rows with
:func:`check_reasoning_parser`; :func:`think_cases` gives the table of ``<think>`` formats.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.parsers import ReasoningParser, ToolCall, ToolParser

#: The tools every case declares.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    },
]

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "days": 3}))
ADD = ToolCall("add", json.dumps({"a": 1.5, "b": 2}))


@dataclass
class ToolFormat:
    """How a format writes calls: ``write(calls)`` is the text of those calls (one block, or one
    per call, as the model would write them); ``content_after``: whether text may follow the
    calls (formats whose calls run to the end of the output cannot)."""

    write: Callable[[list[ToolCall]], str]
    content_after: bool = True
    content_before: bool = True
    malformed: str | None = None  # a call the parser must not take; default: broken JSON
    between: str = ""  # content that ``write`` puts between blocks of calls (a newline, ...)


@dataclass
class ToolCase:
    name: str
    text: str
    content: str | None
    calls: list[ToolCall]


def tool_cases(fmt: ToolFormat) -> list[ToolCase]:
    one, two = fmt.write([WEATHER]), fmt.write([WEATHER, ADD])
    cases = [
        ToolCase("absent", "The weather is fine.", "The weather is fine.", []),
        ToolCase("stray angle bracket", "1 < 2 and [x] > {y}", "1 < 2 and [x] > {y}", []),
        ToolCase("single", one, None, [WEATHER]),
        ToolCase("parallel", two, None, [WEATHER, ADD]),
        ToolCase("cut short", one[: len(one) * 2 // 3], one[: len(one) * 2 // 3], []),
    ]
    if fmt.content_before:
        cases.append(
            ToolCase("content before", "Let me check. " + one, "Let me check. ", [WEATHER])
        )
    if fmt.content_after:
        cases.append(ToolCase("content after", one + "\nDone.", "\nDone.", [WEATHER]))
        both = "Sure.\n" + two + "\nAll done."
        cases.append(
            ToolCase(
                "parallel between content",
                both,
                "Sure.\n" + fmt.between + "\nAll done.",
                [WEATHER, ADD],
            )
        )
    bad = fmt.malformed or one.replace('"Paris"', '"Paris')
    cases.append(ToolCase("malformed", bad, bad, []))
    return cases


def _calls(calls: Sequence[ToolCall]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def stream_tool_parser(
    parser_cls: type[ToolParser], text: str, size: int, tools: list[dict[str, Any]] = TOOLS
) -> tuple[str, list[ToolCall]]:
    """Feed ``text`` in pieces of ``size`` characters; the content and calls the deltas add up
    to (arguments concatenated by index; every call's first delta has its id and name)."""
    parser = parser_cls(tools)
    content, names, args = "", {}, {}
    deltas = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
    for d in [*deltas, parser.finish()]:
        content += d.content
        for c in d.tool_calls:
            if c.index not in names:
                assert c.id and c.name, f"the first delta of call {c.index} lacks its id or name"
                assert c.index == len(names), f"call {c.index} came before call {len(names)}"
                names[c.index], args[c.index] = c.name, ""
            args[c.index] += c.arguments
    return content, [ToolCall(names[i], args[i]) for i in sorted(names)]


def check_tool_parser(
    parser_cls: type[ToolParser], fmt: ToolFormat, tools: list[dict[str, Any]] = TOOLS
) -> None:
    """Every case of :func:`tool_cases`, whole and streamed (pieces of 1, 2, 7 and all
    characters); raises ``AssertionError`` naming the case."""
    for case in tool_cases(fmt):
        got = parser_cls(tools).parse(case.text)
        assert got.content == case.content, f"{case.name}: content {got.content!r}"
        assert _calls(got.tool_calls) == _calls(case.calls), f"{case.name}: {got.tool_calls}"
        for size in (1, 2, 7, max(1, len(case.text))):
            content, calls = stream_tool_parser(parser_cls, case.text, size, tools)
            assert content == (case.content or ""), f"{case.name} streamed by {size}: {content!r}"
            assert _calls(calls) == _calls(case.calls), f"{case.name} streamed by {size}: {calls}"


def think_cases(starts_inside: bool) -> list[tuple[str, str | None, str | None]]:
    """(output, reasoning, content) rows for ``<think>`` tags; ``starts_inside``: the template
    opened the tag, so the output may lack it."""
    rows: list[tuple[str, str | None, str | None]] = [
        ("<think>Two plus two.</think>Four.", "Two plus two.", "Four."),
        ("<think>\nhm\n</think>\n\nFour.", "\nhm\n", "\n\nFour."),
        ("<think></think>Four.", None, "Four."),
        ("<think>a < b, </thin k></think>x", "a < b, </thin k>", "x"),
    ]
    if starts_inside:
        rows += [
            ("Two plus two.</think>Four.", "Two plus two.", "Four."),
            ("still thinking", "still thinking", None),
        ]
    else:
        rows += [
            ("Four.", None, "Four."),
            ("<thing>Four.", None, "<thing>Four."),
            ("<think>cut short", "cut short", None),
        ]
    return rows


def check_reasoning_parser(
    parser_cls: Callable[[], ReasoningParser],
    cases: Sequence[tuple[str, str | None, str | None]],
) -> None:
    """Each (output, reasoning, content) row whole and streamed (pieces of 1, 3 and all
    characters); raises ``AssertionError`` naming the row."""
    for text, reasoning, content in cases:
        assert parser_cls().parse(text) == (reasoning, content), f"{text!r}"
        for size in (1, 3, max(1, len(text))):
            parser = parser_cls()
            deltas = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
            deltas.append(parser.finish())
            got = ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas))
            assert got == (reasoning or "", content or ""), f"{text!r} streamed by {size}: {got}"
