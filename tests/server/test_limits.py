"""Requests that would make the engine do unbounded work are refused with a 400 naming the limit
(``server.*`` keys, their defaults here); requests at the limit are served."""

from __future__ import annotations

import json

import httpx
import pytest

from pagoda.config.model import ServerConfig

LIMITS = ServerConfig()
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def _post(server, path: str, body: dict | bytes) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {**server.headers, "content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", headers=headers, timeout=120, **kwargs)


def _nested(depth: int) -> bytes:
    return b'{"prompt": "Hi", "max_tokens": 1, "user": "x", "logit_bias": {}, "stop": ' + (
        b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    )


OVER = [
    ("stop strings", COMPLETIONS, {"prompt": "Hi", "stop": [f"s{i}" for i in range(65)]},
     "stop", "server.max_stop_strings"),
    ("a long stop string", CHAT, {"messages": MESSAGES, "stop": "x" * 1025},
     "stop", "server.max_stop_string_chars"),
    ("bad words", COMPLETIONS, {"prompt": "Hi", "bad_words": [f"w{i}" for i in range(65)]},
     "bad_words", "server.max_stop_strings"),
    ("logit_bias entries", CHAT,
     {"messages": MESSAGES, "logit_bias": {str(i): 1.0 for i in range(1025)}},
     "logit_bias", "server.max_logit_bias"),
    ("prompts in one request", COMPLETIONS, {"prompt": ["Hi"] * 257, "max_tokens": 1},
     "prompt", "server.max_prompts_per_request"),
    ("token-id prompts in one request", COMPLETIONS, {"prompt": [[1, 2]] * 257},
     "prompt", "server.max_prompts_per_request"),
    ("messages", CHAT, {"messages": MESSAGES * 2049}, "messages", "server.max_messages"),
    ("tokenize messages", "/tokenize", {"messages": MESSAGES * 2049},
     "messages", "server.max_messages"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "path", "body", "param", "key"), OVER, ids=[case[0] for case in OVER]
)
def test_over_a_limit_is_a_400_naming_the_field_and_the_key(
    server, name: str, path: str, body: dict, param: str, key: str
) -> None:
    resp = _post(server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert key in error["message"]


def test_at_the_limits_requests_are_served(server) -> None:
    body = {
        "prompt": ["Hi", "there"],
        "max_tokens": 1,
        "stop": [f"s{i}" for i in range(LIMITS.max_stop_strings - 1)] + ["x" * 1024],
        "logit_bias": {str(i): 0.5 for i in range(LIMITS.max_logit_bias)},
    }
    resp = _post(server, COMPLETIONS, body)
    assert resp.status_code == 200, resp.text
    chat = {"messages": MESSAGES * 8, "max_tokens": 1}
    resp = _post(server, CHAT, chat)
    assert resp.status_code == 200, resp.text


def test_json_nested_past_the_limit_is_a_400(server) -> None:
    assert LIMITS.max_json_depth == 64
    ok = _post(server, COMPLETIONS, _nested(64))  # parses; the route says stop is not strings
    assert ok.status_code == 400 and ok.json()["error"]["code"] != "json_too_deep"
    for depth in (65, 100_000):
        resp = _post(server, COMPLETIONS, _nested(depth))
        assert resp.status_code == 400, resp.text[:300]
        error = resp.json()["error"]
        assert error["code"] == "json_too_deep" and "server.max_json_depth" in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, b'{"prompt": "\\ud800"}', "prompt"),
        (COMPLETIONS, b'{"prompt": ["ok", "a\\udfff"]}', "prompt.1"),
        (CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages.0.content"),
        (CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "model": "\\ud800"}', "model"),
        (COMPLETIONS, b'{"prompt": "Hi", "request_id": "\\ud800x"}', "request_id"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        # The raw bytes of a surrogate (not valid UTF-8), which json.loads decodes all the same.
        ("/detokenize", b'{"tokens": [1], "model": "\xed\xa0\x80"}', "model"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_where_it_is(
    server, path: str, body: bytes, param: str
) -> None:
    resp = _post(server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_unicode"


def test_an_escaped_surrogate_pair_is_ordinary_text(server) -> None:
    body = json.dumps({"prompt": "Hi \U0001f600", "max_tokens": 1}).encode()  # \ud83d\ude00
    assert b"\\ud83d" in body
    assert _post(server, COMPLETIONS, body).status_code == 200
