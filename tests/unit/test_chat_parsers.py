"""The server's glue of reasoning and tool parsers per choice (``chat_parsers.py``): the message
of a finished choice, a stream's deltas adding up to it, ``parallel_tool_calls: false``, and the
settings it refuses."""

from __future__ import annotations

import json

import pytest

from pagoda.config import ServerConfig
from pagoda.entrypoints.openai.chat_parsers import ServerParsers
from pagoda.entrypoints.openai.structured import tool_plan

pytest.importorskip("pagoda_tool_parsers")

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "sub"}},
]
OUTPUT = (
    "<think>Sum, then difference.</think>On it.\n"
    '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
    '<tool_call>{"name": "sub", "arguments": {"b": 2}}</tool_call>'
)


def _parsers(**settings) -> ServerParsers:
    base = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    return ServerParsers.of(ServerConfig(**{**base, **settings}))


def _stream(parser, text: str, size: int) -> dict:
    got = {"reasoning_content": "", "content": "", "tool_calls": []}
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        delta = parser.feed(piece, final=i == len(pieces) - 1)
        got["reasoning_content"] += delta.get("reasoning_content", "")
        got["content"] += delta.get("content", "")
        got["tool_calls"] += [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in delta.get("tool_calls", [])
        ]
    return got


@pytest.mark.parametrize("size", [1, 5, len(OUTPUT)])
def test_reasoning_content_and_calls_whole_and_streamed_agree(size: int) -> None:
    parsers = _parsers(reasoning_parser="qwen3")
    plan = tool_plan(TOOLS, "auto", None)
    message = parsers.choice(plan).message(OUTPUT)
    assert message["reasoning_content"] == "Sum, then difference."
    assert message["content"] == "On it.\n\n"
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    assert calls == [("add", {"a": 1}), ("sub", {"b": 2})]
    parser = parsers.choice(plan)
    got = _stream(parser, OUTPUT, size)
    assert got == {
        "reasoning_content": message["reasoning_content"],
        "content": message["content"],
        "tool_calls": calls,
    }
    assert parser.called


def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed() -> None:
    plan = tool_plan(TOOLS, "auto", False)
    parsers = _parsers()
    assert len(parsers.choice(plan).message(OUTPUT)["tool_calls"]) == 1
    assert [name for name, _ in _stream(parsers.choice(plan), OUTPUT, 3)["tool_calls"]] == ["add"]


def test_without_tools_only_reasoning_is_split_and_forced_calls_pass_through() -> None:
    parsers = _parsers(reasoning_parser="qwen3")
    message = parsers.choice(None).message("<think>hm</think><tool_call>x</tool_call>")
    assert message == {
        "role": "assistant",
        "content": "<tool_call>x</tool_call>",
        "reasoning_content": "hm",
    }
    assert parsers.choice(tool_plan(TOOLS, "required", None)) is None
    assert _parsers().choice(None) is None


def test_the_grammar_is_a_structural_tag_of_the_declared_tools() -> None:
    constraint = _parsers(tool_call_grammar=True).constraint(tool_plan(TOOLS, "auto", False))
    tag = json.loads(constraint.structural_tag)
    assert tag["format"]["triggers"] == ["<tool_call>"] and tag["format"]["stop_after_first"]
    assert [t["begin"].split('"')[3] for t in tag["format"]["tags"]] == ["add", "sub"]


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"tool_call_parser": "nope"}, "unknown tool parser 'nope'; available: hermes"),
        ({"tool_call_parser": None}, "needs server.tool_call_parser"),
        ({"reasoning_parser": "nope"}, "available: deepseek_r1, qwen3"),
    ],
)
def test_bad_parser_settings_are_refused_naming_what_is_available(settings, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        _parsers(**settings)


def test_auto_on_a_server_without_a_parser_is_refused_by_name() -> None:
    parsers = ServerParsers.of(ServerConfig())
    with pytest.raises(ValueError, match="not supported by this server"):
        parsers.check(tool_plan(TOOLS, None, None))


def test_mistral_keeps_special_tokens_for_auto_requests_only() -> None:
    parsers = _parsers(tool_call_parser="mistral")
    assert parsers.keeps_special_tokens(tool_plan(TOOLS, "auto", None))
    assert not parsers.keeps_special_tokens(tool_plan(TOOLS, "required", None))
    assert not _parsers().keeps_special_tokens(tool_plan(TOOLS, "auto", None))
