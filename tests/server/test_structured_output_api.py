"""Structured output through the official ``openai`` client against ``pagoda serve``:
``response_format`` (json_schema with strict, json_object), vLLM's ``structured_outputs`` and
``guided_*`` extras, forced tool calls as ``tool_calls``, streaming with n > 1, bad constraints
as 400s (the server keeps serving), and the compile metrics."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

pytest.importorskip("xgrammar")

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "Tell me about Paris."}]
BAD_SCHEMA = {"name": "x", "schema": {"type": "objekt"}}


def test_response_format_json_schema_strict_output_validates(client, model_name) -> None:
    resp = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        max_tokens=60,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY, "strict": True},
        },
    )
    jsonschema.validate(json.loads(resp.choices[0].message.content), CITY)
    assert resp.choices[0].finish_reason == "stop"


def test_streamed_json_schema_with_n_2_validates_per_choice(client, model_name) -> None:
    stream = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        max_tokens=60,
        n=2,
        temperature=1.0,
        seed=5,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}},
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), CITY)


def test_completions_json_object_and_vllm_extras(client, model_name) -> None:
    out = client.completions.create(
        model=model_name,
        prompt="A JSON object about a cat:",
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},  # vLLM takes it on completions
    )
    assert isinstance(json.loads(out.choices[0].text), dict)
    out = client.completions.create(
        model=model_name,
        prompt="A phone number:",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.choices[0].text)
    out = client.completions.create(
        model=model_name,
        prompt="Is water wet? Answer:",
        max_tokens=5,
        temperature=1.0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert out.choices[0].text in ("yes", "no")
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = client.completions.create(
        model=model_name,
        prompt="JSON:",
        max_tokens=12,
        temperature=0,
        extra_body={"guided_json": small},
    )
    jsonschema.validate(json.loads(out.choices[0].text), small)


def test_named_tool_choice_returns_a_tool_call_whose_arguments_validate(client, model_name) -> None:
    resp = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        max_tokens=40,
        temperature=0,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    message = resp.choices[0].message
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    assert message.content is None


def test_required_tool_choice_calls_only_the_given_tools(client, model_name) -> None:
    resp = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "What time is it in Berlin?"}],
        max_tokens=60,
        temperature=0,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])


def test_streamed_forced_tool_call_arrives_as_tool_calls(client, model_name) -> None:
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        max_tokens=40,
        temperature=0,
        stream=True,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    calls = [tc for chunk in stream for c in chunk.choices for tc in c.delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(
        json.loads(calls[0].function.arguments), WEATHER_TOOL["function"]["parameters"]
    )


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": BAD_SCHEMA}}, "JSON schema"),
        ({"extra_body": {"guided_regex": "([a-z"}}, "regex"),
        ({"extra_body": {"guided_grammar": "root ::= missing_rule"}}, "EBNF grammar"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "exactly one"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_constraint_is_a_400_naming_it_and_the_server_keeps_serving(
    client, model_name, extra, problem
) -> None:
    with pytest.raises(openai.BadRequestError, match=problem):
        client.chat.completions.create(model=model_name, messages=ASK, max_tokens=8, **extra)
    ok = client.chat.completions.create(
        model=model_name, messages=ASK, max_tokens=4, extra_body={"guided_choice": ["a", "b"]}
    )
    assert ok.choices[0].message.content in ("a", "b")


def test_metrics_show_grammar_compile_time_and_cache_hits(client, model_name, server) -> None:
    for _ in range(2):
        client.completions.create(
            model=model_name,
            prompt="Pick:",
            max_tokens=4,
            extra_body={"guided_choice": ["left", "right"]},
        )
    metrics = server.metrics()
    assert metrics["pagoda:structured_output_compile_seconds_count"] >= 1
    assert metrics["pagoda:structured_output_cache_hits_total"] >= 1
    assert metrics["pagoda:structured_output_cache_queries_total"] >= 2
