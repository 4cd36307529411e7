"""Property-based fuzzing of the HTTP API: generated requests (mutated bodies of every route,
token-id prompts, nested message content, unicode edge cases with lone surrogates, numeric
extremes, malformed JSON, unknown routes and methods) never get a 5xx, every error is in OpenAI's
shape, and every 200 stream ends cleanly. Seeded and bounded: ``PAGODA_FUZZ_CASES`` cases (1,000
by default; ``PAGODA_FUZZ_CASES=10000`` for a long run)."""

from __future__ import annotations

import json
import os
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CASES = int(os.environ.get("PAGODA_FUZZ_CASES", "1000"))

# ---- values ----------------------------------------------------------------------------------

# Any code point, lone surrogates included (json.dumps escapes them as \udXXX).
ANY_CHAR = st.characters(blacklist_categories=())
EDGE_TEXT = st.sampled_from(
    ["", " ", "\ud800", "\udfff", "a\udc00b", "\x00", "\u202e", "\ufeff", "😀", "\U0010ffff",
     "<|im_start|>", "<|im_end|>", "{{ 7 * 7 }}", "{% for x in y %}", "\\u0000", "x" * 3000]
)  # fmt: skip
TEXT = st.one_of(st.text(ANY_CHAR, max_size=12), EDGE_TEXT)
EDGE_NUMBERS = st.sampled_from(
    [0, 1, -1, 2, 3, 20, 21, 128, 129, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64,
     10**30, 0.0, -0.0, 0.5, 1.5, 2.0, 2.0001, -2.0001, 1e-308, 1e308, -1e308,
     float("inf"), float("-inf"), float("nan")]
)  # fmt: skip
NUMBER = st.one_of(EDGE_NUMBERS, st.integers(-(2**70), 2**70), st.floats())
LEAF = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
JSON = st.recursive(
    LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)
TOKEN_ID = st.one_of(st.integers(0, 49151), EDGE_NUMBERS, st.integers(-5, 60000))
TOKEN_IDS = st.lists(TOKEN_ID, max_size=8)
SMALL = st.one_of(st.integers(1, 3), EDGE_NUMBERS, st.none(), TEXT, st.booleans())
PROMPT = st.one_of(
    TEXT, st.lists(TEXT, max_size=4), TOKEN_IDS, st.lists(TOKEN_IDS, max_size=3), JSON
)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "tex"])}),
    st.dictionaries(TEXT, JSON, max_size=3),
)
MESSAGE = st.builds(
    lambda message, extra: {**extra, **message},  # an unknown key besides the known ones
    st.fixed_dictionaries(
        {
            "role": st.one_of(
                st.sampled_from(["system", "developer", "user", "assistant", "tool"]), TEXT
            ),
            "content": st.one_of(TEXT, st.lists(PART, max_size=3), st.none(), JSON),
        },
        optional={"name": st.one_of(TEXT, JSON), "tool_calls": JSON},
    ),
    st.dictionaries(TEXT, JSON, max_size=1),
)
MESSAGES = st.one_of(st.lists(MESSAGE, min_size=1, max_size=4), st.lists(MESSAGE), JSON)

# What each field may become: valid values and every kind of wrong one.
FIELDS = {
    "model": st.one_of(st.none(), TEXT, JSON),
    "max_tokens": SMALL,
    "max_completion_tokens": SMALL,
    "n": st.one_of(st.integers(1, 3), EDGE_NUMBERS, TEXT),
    "temperature": st.one_of(NUMBER, st.none(), TEXT),
    "top_p": st.one_of(NUMBER, st.none()),
    "top_k": st.one_of(NUMBER, st.none()),
    "min_p": st.one_of(NUMBER, st.none()),
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "repetition_penalty": st.one_of(NUMBER, st.none()),
    "seed": st.one_of(NUMBER, st.none(), TEXT),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5), st.none(), JSON),
    "stop_token_ids": st.one_of(TOKEN_IDS, JSON),
    "bad_words": st.one_of(st.lists(TEXT, max_size=3), JSON),
    "allowed_token_ids": st.one_of(TOKEN_IDS, JSON),
    "logit_bias": st.one_of(
        st.dictionaries(st.one_of(st.integers(-3, 60000).map(str), TEXT), NUMBER, max_size=4),
        JSON,
    ),
    "logprobs": st.one_of(st.booleans(), SMALL, NUMBER),
    "top_logprobs": st.one_of(SMALL, NUMBER),
    "echo": st.one_of(st.booleans(), JSON),
    "stream": st.one_of(st.booleans(), JSON),
    "stream_options": st.one_of(
        st.fixed_dictionaries(
            {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
        ),
        JSON,
    ),
    "min_tokens": st.one_of(st.integers(0, 3), EDGE_NUMBERS),
    "ignore_eos": st.one_of(st.booleans(), JSON),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "priority": st.one_of(st.integers(-5, 5), EDGE_NUMBERS),
    "request_id": st.one_of(st.just("fixed-id"), TEXT, JSON),
    "user": st.one_of(TEXT, JSON),
    "best_of": st.one_of(SMALL, NUMBER),
    "add_special_tokens": st.one_of(st.booleans(), JSON),
    "add_generation_prompt": st.one_of(st.booleans(), JSON),
    "continue_final_message": st.one_of(st.booleans(), JSON),
    "chat_template": st.one_of(TEXT, JSON),
    "chat_template_kwargs": st.one_of(
        st.dictionaries(
            st.sampled_from(["enable_thinking", "chat_template", "tokenize", "x", "tools"]),
            JSON,
            max_size=3,
        ),
        JSON,
    ),
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "nonsense"}]), JSON
    ),
    "tools": JSON,
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), JSON),
    "suffix": JSON,
    "prompt": PROMPT,
    "messages": MESSAGES,
    "tokens": st.one_of(TOKEN_IDS, JSON),
    "prompt_logprobs": SMALL,
}
FIELD_NAMES = st.one_of(st.sampled_from(sorted(FIELDS)), TEXT)

# Each route's smallest good request: mutations start from it, so most cases reach deep code.
BASE = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "max_completion_tokens": 2,
    },
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}


@st.composite
def json_requests(draw: st.DrawFn) -> tuple[str, str, bytes]:
    path = draw(st.sampled_from(sorted(BASE)))
    body = dict(BASE[path])
    for _ in range(draw(st.integers(1, 4))):
        name = draw(FIELD_NAMES)
        if draw(st.integers(0, 9)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(FIELDS.get(name, JSON))
    if path == "/v1/chat/completions":  # keep outputs short: room-sized defaults take seconds
        for key in ("max_tokens", "max_completion_tokens"):
            if body.get(key) is None:
                body[key] = 2
    data = json.dumps(body, ensure_ascii=draw(st.booleans()), allow_nan=True)
    return "POST", path, data.encode("utf-8", "surrogatepass")


RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"[", b"null", b"[]", b"{}", b'"x"', b"1e999", b'{"prompt": }',
                     b'{"prompt": "a"} trailing', b"\xff\xfe", b'{"prompt": "\\ud800"}',
                     b'{"prompt": "Hi", "prompt": 3}', b"[" * 5000]),
)  # fmt: skip


@st.composite
def raw_requests(draw: st.DrawFn) -> tuple[str, str, bytes]:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]))
    path = draw(
        st.one_of(
            st.sampled_from(
                [*BASE, "/v1/models", "/health", "/version", "/metrics", "/v1/embeddings",
                 "/", "/v1", "/v1/completions/", "/docs", "/openapi.json", "/v1/models/x"]
            ),
            st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=12).map(
                lambda s: "/" + s.replace("?", "").replace("#", "")
            ),
        )
    )  # fmt: skip
    return method, path, draw(RAW_BODIES)


REQUESTS = st.one_of(json_requests(), json_requests(), json_requests(), raw_requests())


def check_response(method: str, path: str, resp: httpx.Response) -> None:
    where = f"{method} {path} -> {resp.status_code}: {resp.text[:300]!r}"
    assert resp.status_code < 500, where
    ctype = resp.headers.get("content-type", "")
    if method == "HEAD":
        return  # no body to check
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, where
        assert isinstance(error["message"], str) and error["message"], where
    elif ctype.startswith("text/event-stream"):
        events = [e for e in resp.text.split("\n\n") if e]
        assert events and events[-1] == "data: [DONE]", where
        for event in events[:-1]:
            chunk = json.loads(event.removeprefix("data: "))
            assert "error" not in chunk, where  # admitted requests do not fail in-band
    elif ctype.startswith("application/json"):
        json.loads(resp.text)



def test_generated_requests_never_get_a_5xx_and_errors_are_openai_shaped(tiny_server) -> None:
    seen = []
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=120) as c:

        @settings(
            max_examples=CASES,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(REQUESTS)
        def one(request: tuple[str, str, bytes]) -> None:
            method, path, body = request
            headers = {"content-type": "application/json"} if body else {}
            resp = c.request(method, path, content=body or None, headers=headers)
            seen.append(resp.status_code)
            check_response(method, path, resp)

        start = time.monotonic()
        one()
    assert len(seen) >= CASES, len(seen)
    statuses = set(seen)
    assert 200 in statuses and 400 in statuses, statuses  # deep code was reached, and refused
    m = tiny_server.wait_idle()
    assert m["pagoda:num_requests_running"] == 0 and m["pagoda:kv_cache_usage_perc"] == 0, m
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200
    print(f"{len(seen)} cases in {time.monotonic() - start:.1f} s: {sorted(statuses)}")
