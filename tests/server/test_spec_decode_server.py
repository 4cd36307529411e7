"""The OpenAI server with n-gram speculation on: completions and chat, streamed or not, give the
same greedy text, and ``/metrics`` shows the drafts and accepted tokens counters moving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from serverkit import Server

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
PROMPT = (
    "Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries, "
    "apples, pears, plums, cherries.\nList: apples, pears,"
)


@pytest.fixture(scope="module")
def spec_server() -> Iterator[Server]:
    srv = Server("--speculative-config", json.dumps(SPEC), "--prompt-lookup-max", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spec_client(spec_server: Server):
    import openai

    return openai.OpenAI(
        base_url=f"{spec_server.url}/v1", api_key=spec_server.api_key, max_retries=0, timeout=120
    )


def _counters(server: Server) -> tuple[float, float, float]:
    m = server.metrics()
    return (
        m.get("pagoda:spec_decode_num_drafts_total", 0.0),
        m.get("pagoda:spec_decode_num_draft_tokens_total", 0.0),
        m.get("pagoda:spec_decode_num_accepted_tokens_total", 0.0),
    )


def test_completion_streamed_or_not_and_metrics_move(spec_server, spec_client) -> None:
    model = spec_client.models.list().data[0].id
    before = _counters(spec_server)
    full = spec_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=40, temperature=0.0
    )
    text = full.choices[0].text
    assert full.usage.completion_tokens <= 40 and text
    stream = spec_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=40, temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == text
    drafts, draft_tokens, accepted = (a - b for a, b in zip(_counters(spec_server), before))
    assert drafts > 0 and draft_tokens >= drafts and accepted > 0, (drafts, draft_tokens, accepted)
    assert "pagoda:spec_decode_num_accepted_tokens_per_pos_total" in spec_server.metrics()


def test_chat_stream_with_stop_and_logprobs(spec_client) -> None:
    model = spec_client.models.list().data[0].id
    messages = [{"role": "user", "content": PROMPT}]
    full = spec_client.chat.completions.create(
        model=model, messages=messages, max_tokens=30, temperature=0.0, logprobs=True,
        top_logprobs=2, stop=["cherries"],
    )  # fmt: skip
    choice = full.choices[0]
    assert "cherries" not in choice.message.content
    assert len(choice.logprobs.content) >= 1
    stream = spec_client.chat.completions.create(
        model=model, messages=messages, max_tokens=30, temperature=0.0, stop=["cherries"],
        stream=True,
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == choice.message.content
