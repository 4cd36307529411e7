"""A chat template in a request runs only if the operator opted in, and then inside limits; the
keys of ``chat_template_kwargs`` that the model's own template reads keep working."""

from __future__ import annotations

import time

import httpx
import pytest

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
PWNED = "PWNED {{ messages[0].content }}"


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=60)


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


IN_KWARGS = "chat_template_kwargs.chat_template"


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        (CHAT, {"chat_template_kwargs": {"chat_template": PWNED}}, IN_KWARGS),
        (CHAT, {"chat_template": PWNED}, "chat_template"),
        ("/tokenize", {"chat_template_kwargs": {"chat_template": PWNED}}, IN_KWARGS),
        ("/tokenize", {"chat_template": PWNED}, "chat_template"),
    ],
)
def test_request_template_is_refused_by_default_naming_the_field(
    server, path: str, extra: dict, field: str
) -> None:
    resp = _post(server, path, {"messages": MESSAGES, **extra})
    assert resp.status_code == 400, resp.text
    error = _error(resp)
    assert error["param"] == field and f"`{field}`" in error["message"]
    assert "--trust-request-chat-template" in error["message"]
    assert "PWNED" not in resp.text


def test_template_kwargs_the_model_template_reads_still_work(server) -> None:
    plain = _post(server, "/tokenize", {"messages": MESSAGES})
    kwargs = _post(
        server,
        "/tokenize",
        {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False, "x": [1]}},
    )
    assert plain.status_code == kwargs.status_code == 200
    assert kwargs.json()["tokens"] == plain.json()["tokens"]
    chat = _post(
        server,
        CHAT,
        {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": True}},
    )
    assert chat.status_code == 200, chat.text


def test_apply_chat_template_parameters_are_not_request_kwargs(server) -> None:
    resp = _post(server, CHAT, {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}})
    assert resp.status_code == 400
    assert _error(resp)["param"] == "chat_template_kwargs.tokenize"


def test_with_the_opt_in_a_request_template_renders(guarded_server) -> None:
    resp = _post(
        guarded_server,
        "/tokenize",
        {"messages": MESSAGES, "chat_template": "<{{ messages[0].content }}|{{ eos_token }}>"},
    )
    assert resp.status_code == 200, resp.text
    text = httpx.post(
        f"{guarded_server.url}/detokenize",
        json={"tokens": resp.json()["tokens"]},
        headers=guarded_server.headers,
        timeout=30,
    ).json()["prompt"]
    assert text.startswith("<Hi|") and text.endswith(">")
    chat = _post(
        guarded_server,
        CHAT,
        {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"chat_template": PWNED}},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(
        _post(
            guarded_server, "/tokenize", {"prompt": "PWNED Hi", "add_special_tokens": False}
        ).json()["tokens"]
    )


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{{ 1 / 0 }}", ["ZeroDivisionError"]),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         ["longer than 1 s"]),
        ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", ["exceeds 100000"]),
        ("{{ ().__class__.__base__.__subclasses__() }}", ["unsafe", "__class__"]),
    ],
)  # fmt: skip
def test_with_the_opt_in_a_request_template_is_bounded(
    guarded_server, template: str, words: list[str]
) -> None:
    start = time.monotonic()
    resp = _post(guarded_server, CHAT, {"messages": MESSAGES, "chat_template": template})
    assert time.monotonic() - start < 20
    assert resp.status_code == 400, resp.text
    error = _error(resp)
    assert error["param"] == "chat_template"
    assert any(w in error["message"] for w in words), error["message"]
    assert httpx.get(f"{guarded_server.url}/health", timeout=10).status_code == 200
