"""Reasoning through the official ``openai`` client against ``pagoda serve`` of a random
two-layer Qwen3 (SmolLM2's tokenizer, a Qwen3-style template) with the qwen3 reasoning parser,
the hermes tool parser and the tool-call grammar: the test plugin ``forced_text.py`` makes it
write ``<think>...</think>`` then an answer or a call, and ``reasoning_content`` and
``content`` (or ``tool_calls``, which validate) come back split, whole and streamed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serverkit import Server
from toolkit import ASK, TOOLS, chat, scripts, streamed, tool_server, validate_calls

pytest.importorskip("xgrammar")
pytest.importorskip("pagoda_tool_parsers")

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


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from pagoda.loader import convert_gguf, default_model_path

    return convert_gguf(default_model_path())


@pytest.fixture(scope="module")
def qwen3(smollm2: Path, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, folder / name)
    (folder / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    (folder / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    srv = tool_server(
        scripts(smollm2),
        "--model", str(folder), "--load-format", "dummy", "--reasoning-parser", "qwen3",
        "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
        engine_flags=False,
    )  # fmt: skip
    yield srv
    srv.stop()


def test_qwen3_reasoning_is_split_from_content(qwen3) -> None:
    resp = chat(qwen3).create(messages=ASK, max_tokens=40, extra_body={"request_id": "think"})
    msg = resp.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Two plus two.", "Four.")
    stream = chat(qwen3).create(
        messages=ASK, max_tokens=40, stream=True, extra_body={"request_id": "think"}
    )
    reasoning, content, calls, _ = streamed(stream)
    assert (reasoning, content, calls) == ("Two plus two.", "Four.", [])


def test_qwen3_reasoning_then_calls_under_the_grammarvalidate_calls(qwen3) -> None:
    client = chat(qwen3)
    resp = client.create(
        messages=ASK, tools=TOOLS, max_tokens=160, n=3,
        extra_body={"request_id": "both"},
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert choice.message.reasoning_content == "Weather: ask."
        validate_calls(choice.message.tool_calls)
    stream = client.create(
        messages=ASK, tools=TOOLS, max_tokens=160, stream=True,
        extra_body={"request_id": "both"},
    )  # fmt: skip
    reasoning, _, calls, finish = streamed(stream)
    assert reasoning == "Weather: ask." and finish == "tool_calls"
    validate_calls(calls)


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
    assert text.rstrip().endswith("<think>\n\n</think>")


def test_qwen3_second_turn_renders_the_call_and_the_tool_result(qwen3) -> None:
    client = chat(qwen3)
    first = client.create(
        messages=ASK, tools=TOOLS, max_tokens=160, extra_body={"request_id": "both"}
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    tokens = httpx.post(
        f"{qwen3.url}/tokenize", headers=qwen3.headers, json={"messages": history}, timeout=30
    ).json()["tokens"]
    text = httpx.post(
        f"{qwen3.url}/detokenize", headers=qwen3.headers, json={"tokens": tokens}, timeout=30
    ).json()["prompt"]
    # The template got the arguments as an object (it writes them with tojson).
    arguments = json.dumps(json.loads(call.function.arguments))
    assert f'"arguments": {arguments}' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    second = client.create(messages=history, tools=TOOLS, max_tokens=8)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
