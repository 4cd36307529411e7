"""``tool_choice: auto`` through the official ``openai`` client against ``pagoda serve`` of
SmolLM2 with the hermes parser and the tool-call grammar on (xgrammar structural tags): calls,
whole and streamed, whose arguments validate; ``parallel_tool_calls``; a second turn with the
tool's result; bad tools as 400s; an unknown parser at start-up.

SmolLM2 rarely starts a call by itself: the request's ``request_id`` marker ``call`` has the
test plugin ``forced_text.py`` write ``<tool_call>`` first; the grammar holds the rest.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from serverkit import Server
from toolkit import (
    ASK,
    TOOLS,
    WEATHER,
    chat,
    scripts,
    streamed,
    tool_server,
    validate_calls,
)

pytest.importorskip("xgrammar")
pytest.importorskip("pagoda_tool_parsers")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from pagoda.loader import convert_gguf, default_model_path

    return convert_gguf(default_model_path())


@pytest.fixture(scope="module")
def smol(smollm2: Path) -> Iterator[Server]:
    srv = tool_server(scripts(smollm2))
    yield srv
    srv.stop()


def test_auto_tool_choice_returns_calls_thatvalidate_calls(smol) -> None:
    resp = chat(smol).create(
        messages=ASK, tools=TOOLS, max_tokens=60, n=2,
        extra_body={"request_id": "call"},
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        validate_calls(choice.message.tool_calls)


def test_auto_tool_choice_streams_calls_thatvalidate_calls(smol) -> None:
    stream = chat(smol).create(
        messages=ASK, tools=TOOLS, max_tokens=60, stream=True,
        extra_body={"request_id": "call"},
    )  # fmt: skip
    _, _, calls, finish = streamed(stream)
    assert finish == "tool_calls"
    validate_calls(calls)


def test_parallel_tool_calls_false_gives_one_call(smol) -> None:
    resp = chat(smol).create(
        messages=ASK, tools=TOOLS, max_tokens=80, parallel_tool_calls=False,
        extra_body={"request_id": "call"},
    )  # fmt: skip
    assert len(resp.choices[0].message.tool_calls) == 1


def test_a_second_turn_with_the_tool_result_renders_and_answers(smol) -> None:
    client = chat(smol)
    first = client.create(
        messages=ASK, tools=TOOLS, max_tokens=60, extra_body={"request_id": "call"}
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.create(messages=history, tools=TOOLS, max_tokens=8)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_without_a_call_the_output_is_content(smol) -> None:
    resp = chat(smol).create(messages=ASK, tools=TOOLS, max_tokens=5, temperature=0)
    msg = resp.choices[0].message
    assert not msg.tool_calls and resp.choices[0].finish_reason == "length" and msg.content


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"tools": [{**WEATHER, "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
         "not a JSON schema type"),
        ({"tools": [{**WEATHER, "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "must describe an object"),
        ({"tools": [{**WEATHER, "function": {"name": "f", "parameters": {"type": "object",
           "properties": {"a": {"type": "string", "pattern": "(("}}}}}]},
         "`tools`: invalid structural tag: Regex"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not in `tools`"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400(smol, extra, problem) -> None:
    with pytest.raises(openai.BadRequestError, match=problem):
        chat(smol).create(messages=ASK, max_tokens=4, **extra)


def test_an_unknown_parser_fails_at_start_naming_the_available_ones(tmp_path) -> None:
    args = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--tool-call-parser", "nope"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "unknown tool parser 'nope'" in out.stderr and "hermes" in out.stderr


def test_streamed_logprobs_of_held_text_are_sent_with_it(smol) -> None:
    stream = chat(smol).create(
        messages=ASK, tools=TOOLS, max_tokens=60, stream=True, logprobs=True,
        stream_options={"include_usage": True}, extra_body={"request_id": "call"},
    )  # fmt: skip
    chunks = list(stream)
    sent = sum(len(c.logprobs.content) for ch in chunks for c in ch.choices if c.logprobs)
    assert sent == chunks[-1].usage.completion_tokens
