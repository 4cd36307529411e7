"""Bad requests get the right 4xx with an OpenAI-style error body, never reach the engine, and
leave the server serving."""

from __future__ import annotations

import httpx
import pytest
from serverkit import MAX_MODEL_LEN

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
LONG_PROMPT = "word " * (MAX_MODEL_LEN - 100)  # about 924 tokens

# (name, path, body (dict, or raw bytes), status, words the message must hold, param)
BAD = [
    ("malformed JSON", CHAT, b'{"messages": [', 400, ["JSON"], None),
    ("body is not an object", CHAT, b"[1, 2]", 400, [], None),
    ("messages missing", CHAT, {"max_tokens": 4}, 400, ["messages"], "messages"),
    ("messages empty", CHAT, {"messages": []}, 400, ["messages"], "messages"),
    (
        "max_tokens of the wrong type",
        CHAT,
        {"messages": MESSAGES, "max_tokens": "ten"},
        400,
        ["max_tokens"],
        "max_tokens",
    ),
    (
        "temperature out of range",
        CHAT,
        {"messages": MESSAGES, "temperature": 5},
        400,
        ["temperature"],
        "temperature",
    ),
    ("n of zero", COMPLETIONS, {"prompt": "Hi", "n": 0}, 400, ["n"], "n"),
    (
        "top_p of zero",
        COMPLETIONS,
        {"prompt": "Hi", "top_p": 0},
        400,
        ["top_p"],
        "top_p",
    ),
    (
        "unknown model",
        CHAT,
        {"model": "gpt-17", "messages": MESSAGES},
        404,
        ["gpt-17", "does not exist"],
        "model",
    ),
    (
        "prompt plus max_tokens beyond the context",
        COMPLETIONS,
        {"prompt": LONG_PROMPT, "max_tokens": 200},
        400,
        [str(MAX_MODEL_LEN), "200 in the completion"],
        "max_tokens",
    ),
    (
        "chat messages beyond the context",
        CHAT,
        {"messages": [{"role": "user", "content": LONG_PROMPT * 2}]},
        400,
        [str(MAX_MODEL_LEN), "maximum context length"],
        "messages",
    ),
    (
        "unknown field",
        CHAT,
        {"messages": MESSAGES, "temprature": 0.5},
        400,
        ["temprature", "unknown field"],
        "temprature",
    ),
    (
        "response_format with an invalid JSON schema",
        CHAT,
        {
            "messages": MESSAGES,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objekt"}},
            },
        },
        400,
        ["`response_format`: invalid or unsupported JSON schema", "objekt"],
        "response_format",
    ),
    (
        "guided_regex that does not parse, on completions",
        COMPLETIONS,
        {"prompt": "Hi", "guided_regex": "(ab"},
        400,
        ["`guided_regex`: invalid or unsupported regex"],
        "guided_regex",
    ),
    (
        "tools without a tool parser (tool_choice auto)",
        CHAT,
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        ["tool_choice", "auto", "not supported"],
        None,
    ),
    (
        "tools on completions",
        COMPLETIONS,
        {"prompt": "Hi", "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        ["tools", "/v1/chat/completions"],
        "tools",
    ),
    (
        "image content",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        ["image_url"],
        None,
    ),
    (
        "prompt token id outside the vocabulary",
        COMPLETIONS,
        {"prompt": [1, 2, 10_000_000]},
        400,
        ["token ids"],
        "prompt",
    ),
    (
        "top_logprobs without logprobs",
        CHAT,
        {"messages": MESSAGES, "top_logprobs": 2},
        400,
        ["top_logprobs"],
        None,
    ),
    ("stop string empty", COMPLETIONS, {"prompt": "Hi", "stop": [""]}, 400, ["stop"], "stop"),
    (
        "min_tokens above max_tokens",
        COMPLETIONS,
        {"prompt": "Hi", "max_tokens": 2, "min_tokens": 5},
        400,
        ["min_tokens"],
        "min_tokens",
    ),
    (
        "logit_bias key not a token id",
        COMPLETIONS,
        {"prompt": "Hi", "logit_bias": {"hello": 1}},
        400,
        ["logit_bias"],
        "logit_bias",
    ),
    ("tokenize with no input", "/tokenize", {}, 400, ["prompt"], None),
    (
        "stop token id outside the vocabulary",
        COMPLETIONS,
        {"prompt": "Hi", "stop_token_ids": [10_000_000]},
        400,
        ["stop_token_ids", "vocabulary"],
        "stop_token_ids",
    ),
    (
        "seed beyond 64 bits",
        COMPLETIONS,
        {"prompt": "Hi", "seed": 2**64 - 1, "n": 2},
        400,
        ["seed"],
        "seed",
    ),
    (
        "stream_options without stream",
        CHAT,
        {"messages": MESSAGES, "stream_options": {"include_usage": True}},
        400,
        ["stream_options"],
        None,
    ),
]


@pytest.fixture(scope="module")
def engine_queries_before(server) -> float:
    return server.metrics()["pagoda:prefix_cache_queries_total"]


@pytest.mark.parametrize(
    ("path", "body", "status", "words", "param"),
    [case[1:] for case in BAD],
    ids=[case[0] for case in BAD],
)
def test_bad_request_gets_4xx_with_openai_error_body(
    server, engine_queries_before, path, body, status, words, param
) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {**server.headers, "Content-Type": "application/json"}
    resp = httpx.post(f"{server.url}{path}", headers=headers, timeout=30, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    for word in words:
        assert word in error["message"], error["message"]
    assert "SamplingParams" not in error["message"]  # what the client sent, not a Python class
    if param is not None:
        assert error["param"] == param, error


def test_server_keeps_serving_and_no_bad_request_reached_the_engine(
    server, client, model_name, engine_queries_before
) -> None:
    assert len(BAD) >= 10
    # Each request the engine admits is looked up in the prefix cache; none of the bad ones was.
    assert server.metrics()["pagoda:prefix_cache_queries_total"] == engine_queries_before
    out = client.completions.create(model=model_name, prompt="Hi", max_tokens=2)
    assert out.choices[0].text is not None
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
