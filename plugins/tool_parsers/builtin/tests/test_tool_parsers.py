"""Each built-in parser against the conformance kit's table, and each format's own cases."""

from __future__ import annotations

import json

import pytest

from pagoda.parsers import ToolCall, reasoning_parser_class, tool_parser_class
from pagoda.testing.parsers import (
    TOOLS,
    ToolFormat,
    check_reasoning_parser,
    check_tool_parser,
    stream_tool_parser,
    think_cases,
)


def _hermes(calls: list[ToolCall]) -> str:
    return "\n".join(
        f'<tool_call>\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n</tool_call>'
        for c in calls
    )


def _llama(calls: list[ToolCall]) -> str:
    return "; ".join(f'{{"name": "{c.name}", "parameters": {c.arguments}}}' for c in calls)


def _mistral(calls: list[ToolCall]) -> str:
    body = ", ".join(f'{{"name": "{c.name}", "arguments": {c.arguments}}}' for c in calls)
    return f"[TOOL_CALLS][{body}]"


def _qwen3_coder(calls: list[ToolCall]) -> str:
    out = []
    for c in calls:
        params = "".join(
            f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in json.loads(c.arguments).items()
        )
        out.append(f"<tool_call>\n<function={c.name}>\n{params}</function>\n</tool_call>")
    return "\n".join(out)


FORMATS = {
    "hermes": ToolFormat(_hermes, between="\n"),
    "llama3_json": ToolFormat(_llama, content_after=False, content_before=False),
    "mistral": ToolFormat(_mistral, content_after=False),
    "qwen3_coder": ToolFormat(
        _qwen3_coder,
        malformed="<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n"
        "</tool_call>",
        between="\n",
    ),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tool_parser_passes_the_conformance_table_whole_and_streamed(name: str) -> None:
    check_tool_parser(tool_parser_class(name), FORMATS[name])


def test_hermes_takes_arguments_given_as_json_text() -> None:
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    got = tool_parser_class("hermes")(TOOLS).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("add", {"a": 1})]


def test_hermes_streams_content_before_a_call_starts() -> None:
    parser = tool_parser_class("hermes")(TOOLS)
    assert parser.feed("Let me look <tool").content == "Let me look "
    assert parser.feed("_call>").content == ""


def test_llama3_takes_a_python_tag_and_semicolon_separated_calls() -> None:
    text = 'ok <|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add"}'
    got = tool_parser_class("llama3_json")(TOOLS).parse(text)
    assert got.content == "ok " and [c.name for c in got.tool_calls] == ["add", "add"]


def test_llama3_json_in_the_middle_of_text_is_content() -> None:
    text = 'Use {"name": "add"} like this.'
    assert tool_parser_class("llama3_json")(TOOLS).parse(text).content == text


def test_mistral_reads_the_v11_name_args_form() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]add[ARGS]{"a": 2}'
    got = tool_parser_class("mistral")(TOOLS).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("add", {"a": 2}),
    ]
    content, calls = stream_tool_parser(tool_parser_class("mistral"), text, 3)
    assert content == "" and [c.name for c in calls] == ["get_weather", "add"]


def test_qwen3_coder_types_parameters_by_the_schema() -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    got = tool_parser_class("qwen3_coder")(TOOLS).parse(text)
    assert json.loads(got.tool_calls[0].arguments) == {"city": "42", "days": 3}


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder"])
def test_structural_tag_accepts_the_formats_own_calls_and_refuses_bad_arguments(name) -> None:
    xgr = pytest.importorskip("xgrammar")
    grammar = xgr.Grammar.from_structural_tag(
        json.dumps(tool_parser_class(name)(TOOLS).structural_tag())
    )
    accepts = xgr.testing._is_grammar_accept_string
    good = FORMATS[name].write([ToolCall("get_weather", json.dumps({"city": "Oslo"}))])
    assert accepts(grammar, "Sure. " + good + " Done.")
    bad = FORMATS[name].write([ToolCall("get_weather", json.dumps({"days": 3}))])  # no city
    assert not accepts(grammar, "Sure. " + bad)


@pytest.mark.parametrize(("name", "inside"), [("qwen3", False), ("deepseek_r1", True)])
def test_reasoning_parser_passes_the_think_table_whole_and_streamed(
    name: str, inside: bool
) -> None:
    check_reasoning_parser(reasoning_parser_class(name), think_cases(inside))


def test_hermes_takes_a_control_character_inside_a_string_and_escapes_it() -> None:
    text = '<tool_call>{"name": "add", "arguments": {"s": "a\x1ab"}}</tool_call>'
    (call,) = tool_parser_class("hermes")(TOOLS).parse(text).tool_calls
    assert call.arguments == '{"s": "a\\u001ab"}' and json.loads(call.arguments) == {"s": "a\x1ab"}
