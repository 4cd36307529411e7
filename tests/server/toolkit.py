"""What the tool-calling and reasoning server tests share: tools, a ``pagoda serve`` with the
test plugin ``forced_text.py`` (a request whose ``request_id`` holds a marker writes a script of
tokens first: ``<tool_call>``, or ``<think>...</think>`` then an answer), and readers of the
``openai`` client's answers."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jsonschema
import openai
from serverkit import Server

HERE = Path(__file__).resolve().parent
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def scripts(folder: Path) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = {
        "call": tok.encode("<tool_call>", add_special_tokens=False),
        "think": tok.encode("<think>Two plus two.</think>Four.", add_special_tokens=False)
        + [tok.convert_tokens_to_ids("<|im_end|>")],
        "both": tok.encode("<think>Weather: ask.</think><tool_call>", add_special_tokens=False),
    }
    return json.dumps(ids)


def tool_server(scripts: str, *args: str, engine_flags: bool = True) -> Server:
    env = {
        "PAGODA_TEST_SCRIPTS": scripts,
        "PAGODA_PLUGIN_MODULES": "forced_text",
        "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path]),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return Server(
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-call-grammar",
            *args, engine_flags=engine_flags,
        )  # fmt: skip
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Chat:
    """The ``openai`` client's chat completions of one server, its model filled in."""

    def __init__(self, srv: Server) -> None:
        self.client = openai.OpenAI(
            base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=120
        )
        self.model = self.client.models.list().data[0].id

    def create(self, **kwargs):
        return self.client.chat.completions.create(model=self.model, **kwargs)


def chat(srv: Server) -> Chat:
    return Chat(srv)


def validate_calls(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(stream) -> tuple[str, str, list, str | None]:
    """(reasoning, content, calls as objects with .function.name/.arguments, finish_reason)"""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name
                    calls[tc.index] = tc.model_copy(deep=True)
                else:
                    calls[tc.index].function.arguments += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish
