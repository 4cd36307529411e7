"""``tool_choice: auto`` and reasoning through the official ``openai`` client against
``pagoda serve``: SmolLM2 with the hermes parser, and a random two-layer Qwen3 (SmolLM2's
tokenizer, a Qwen3-style template) with the qwen3 reasoning parser; both with the tool-call
grammar on (xgrammar structural tags), so every call's arguments validate.

A random or tiny model rarely starts a call by itself: the test plugin ``forced_text.py`` makes
a request whose ``request_id`` holds a marker write a script of tokens first (``<tool_call>``,
or ``<think>...</think>`` then an answer), and the grammar and the parsers take it from there.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from serverkit import Server

pytest.importorskip("xgrammar")
pytest.importorskip("pagoda_tool_parsers")

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
QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{%- endif %}"
)
QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _scripts(folder: Path) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = {
        "call": tok.encode("<tool_call>", add_special_tokens=False),
        "think": tok.encode("<think>Two plus two.</think>Four.", add_special_tokens=False)
        + [tok.convert_tokens_to_ids("<|im_end|>")],
        "both": tok.encode("<think>Weather: ask.</think><tool_call>", add_special_tokens=False),
    }
    return json.dumps(ids)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from pagoda.loader import convert_gguf, default_model_path

    return convert_gguf(default_model_path())


def _server(scripts: str, *args: str, engine_flags: bool = True) -> Server:
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


class _Chat:
    """The ``openai`` client's chat completions of one server, its model filled in."""

    def __init__(self, srv: Server) -> None:
        self.client = openai.OpenAI(
            base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=120
        )
        self.model = self.client.models.list().data[0].id

    def create(self, **kwargs):
        return self.client.chat.completions.create(model=self.model, **kwargs)


def _client(srv: Server) -> _Chat:
    return _Chat(srv)


@pytest.fixture(scope="module")
def smol(smollm2: Path) -> Iterator[Server]:
    srv = _server(_scripts(smollm2))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def qwen3(smollm2: Path, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, folder / name)
    (folder / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    (folder / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    srv = _server(
        _scripts(smollm2),
        "--model", str(folder), "--load-format", "dummy", "--reasoning-parser", "qwen3",
        "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
        engine_flags=False,
    )  # fmt: skip
    yield srv
    srv.stop()


def _validate(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(stream) -> tuple[str, str, list, str | None]:
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


def test_auto_tool_choice_returns_calls_that_validate(smol) -> None:
    resp = _client(smol).create(
        messages=ASK, tools=TOOLS, max_tokens=60, n=2,
        extra_body={"request_id": "call"},
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        _validate(choice.message.tool_calls)


def test_auto_tool_choice_streams_calls_that_validate(smol) -> None:
    stream = _client(smol).create(
        messages=ASK, tools=TOOLS, max_tokens=60, stream=True,
        extra_body={"request_id": "call"},
    )  # fmt: skip
    _, _, calls, finish = _streamed_calls(stream)
    assert finish == "tool_calls"
    _validate(calls)


def test_parallel_tool_calls_false_gives_one_call(smol) -> None:
    resp = _client(smol).create(
        messages=ASK, tools=TOOLS, max_tokens=80, parallel_tool_calls=False,
        extra_body={"request_id": "call"},
    )  # fmt: skip
    assert len(resp.choices[0].message.tool_calls) == 1


def test_a_second_turn_with_the_tool_result_renders_and_answers(smol) -> None:
    client = _client(smol)
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
    resp = _client(smol).create(messages=ASK, tools=TOOLS, max_tokens=5, temperature=0)
    msg = resp.choices[0].message
    assert not msg.tool_calls and resp.choices[0].finish_reason == "length" and msg.content


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"tools": [{**WEATHER, "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
         "not a JSON schema type"),
        ({"tools": [{**WEATHER, "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "must describe an object"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not in `tools`"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400(smol, extra, problem) -> None:
    with pytest.raises(openai.BadRequestError, match=problem):
        _client(smol).create(messages=ASK, max_tokens=4, **extra)


def test_an_unknown_parser_fails_at_start_naming_the_available_ones(tmp_path) -> None:
    args = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--tool-call-parser", "nope"]
    import subprocess

    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "unknown tool parser 'nope'" in out.stderr and "hermes" in out.stderr


def test_qwen3_reasoning_is_split_from_content(qwen3) -> None:
    resp = _client(qwen3).create(messages=ASK, max_tokens=40, extra_body={"request_id": "think"})
    msg = resp.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Two plus two.", "Four.")
    stream = _client(qwen3).create(
        messages=ASK, max_tokens=40, stream=True, extra_body={"request_id": "think"}
    )
    reasoning, content, calls, _ = _streamed_calls(stream)
    assert (reasoning, content, calls) == ("Two plus two.", "Four.", [])


def test_qwen3_reasoning_then_calls_under_the_grammar_validate(qwen3) -> None:
    client = _client(qwen3)
    resp = client.create(
        messages=ASK, tools=TOOLS, max_tokens=160, n=3,
        extra_body={"request_id": "both"},
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert choice.message.reasoning_content == "Weather: ask."
        _validate(choice.message.tool_calls)
    stream = client.create(
        messages=ASK, tools=TOOLS, max_tokens=160, stream=True,
        extra_body={"request_id": "both"},
    )  # fmt: skip
    reasoning, _, calls, finish = _streamed_calls(stream)
    assert reasoning == "Weather: ask." and finish == "tool_calls"
    _validate(calls)


def test_qwen3_enable_thinking_false_reaches_the_template(qwen3) -> None:
    resp = httpx.post(
        f"{qwen3.url}/tokenize",
        headers=qwen3.headers,
        json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}},
        timeout=30,
    )
    tokens = resp.json()["tokens"]
    text = httpx.post(
        f"{qwen3.url}/detokenize", headers=qwen3.headers, json={"tokens": tokens}, timeout=30
    ).json()["prompt"]
    assert text.endswith("<think>\n\n</think>\n\n")
