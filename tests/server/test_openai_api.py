"""``pagoda serve`` through the official ``openai`` client: completions and chat, streamed and
not, n, logprobs, stop strings, seeds, extra sampling fields, tokenize, metrics, auth."""

from __future__ import annotations

import httpx
import openai
import pytest

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name a fruit that is yellow."}]
GREEDY = {"temperature": 0.0, "max_tokens": 12}


def _stream_completion(client, model: str, **kwargs) -> tuple[dict[int, str], list]:
    texts: dict[int, str] = {}
    chunks = list(client.completions.create(model=model, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts, chunks


def _stream_chat(client, model: str, **kwargs) -> tuple[dict[int, str], list]:
    texts: dict[int, str] = {}
    chunks = list(client.chat.completions.create(model=model, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts, chunks


def test_models_lists_the_served_model_with_its_context(client, model_name: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model_name] == ["SmolLM2-135M-Instruct"]  # one id
    assert models[0].model_extra["max_model_len"] == 1024


def test_greedy_completion_streamed_equals_non_streamed(client, model_name: str) -> None:
    full = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY)
    assert full.object == "text_completion" and len(full.choices) == 1
    assert full.choices[0].text and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens > 0
    options = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's extra option
    texts, chunks = _stream_completion(
        client, model_name, prompt=PROMPT, stream_options=options, **GREEDY
    )
    assert texts[0] == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    running = [c.usage.completion_tokens for c in chunks]
    assert running == sorted(running) and running[0] >= 1


def test_greedy_chat_streamed_equals_non_streamed(client, model_name: str) -> None:
    full = client.chat.completions.create(model=model_name, messages=CHAT, **GREEDY)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    texts, chunks = _stream_chat(
        client, model_name, messages=CHAT, stream_options={"include_usage": True}, **GREEDY
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert texts[0] == message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_2_gives_two_choices_streamed_and_not(client, model_name: str) -> None:
    params = {"n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 7}
    full = client.completions.create(model=model_name, prompt=PROMPT, **params)
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert 2 <= full.usage.completion_tokens <= 12
    chat = client.chat.completions.create(model=model_name, messages=CHAT, **params)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    texts, chunks = _stream_chat(client, model_name, messages=CHAT, **params)
    assert sorted(texts) == [0, 1]
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    # The seed fixes both samples: the stream repeats the non-streamed choices.
    assert texts == {c.index: c.message.content for c in chat.choices}


def test_seed_makes_sampled_output_repeat(client, model_name: str) -> None:
    params = {"max_tokens": 10, "temperature": 1.0, "top_p": 0.95}
    a = client.completions.create(model=model_name, prompt=PROMPT, seed=1234, **params)
    b = client.completions.create(model=model_name, prompt=PROMPT, seed=1234, **params)
    assert a.choices[0].text == b.choices[0].text


def test_stop_string_cuts_text_streamed_and_not(client, model_name: str) -> None:
    base = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY).choices[0].text
    stop = base.strip().split()[1][:3]  # from the second word: never at the very start
    cut = client.completions.create(model=model_name, prompt=PROMPT, stop=[stop], **GREEDY)
    choice = cut.choices[0]
    assert choice.text == base[: base.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    texts, _ = _stream_completion(client, model_name, prompt=PROMPT, stop=[stop], **GREEDY)
    assert texts[0] == choice.text
    chat = client.chat.completions.create(model=model_name, messages=CHAT, stop="\n", **GREEDY)
    assert "\n" not in chat.choices[0].message.content


def test_completion_logprobs_in_openai_legacy_format(client, model_name: str) -> None:
    out = client.completions.create(model=model_name, prompt=PROMPT, logprobs=2, **GREEDY)
    choice = out.choices[0]
    lp = choice.logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == choice.text or choice.finish_reason == "stop"
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0 and 2 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert value == pytest.approx(max(top.values()), abs=1e-4)
        assert top[token] == pytest.approx(value, abs=1e-6)
    texts, chunks = _stream_completion(client, model_name, prompt=PROMPT, logprobs=2, **GREEDY)
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert streamed == lp.tokens and texts[0] == choice.text


def test_chat_logprobs_in_openai_chat_format(client, model_name: str) -> None:
    params = {"messages": CHAT, "logprobs": True, "top_logprobs": 3, **GREEDY}
    out = client.chat.completions.create(model=model_name, **params)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-6)
        assert item.bytes == list(item.token.encode())
        ranked = [t.logprob for t in item.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
    _, chunks = _stream_chat(client, model_name, **params)
    streamed = [
        t.token for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content
    ]
    assert streamed == [t.token for t in content]
    plain = client.chat.completions.create(model=model_name, messages=CHAT, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_max_completion_tokens_and_vllm_extra_fields_apply(client, model_name: str) -> None:
    out = client.chat.completions.create(
        model=model_name,
        messages=CHAT,
        max_completion_tokens=5,
        extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    out = client.completions.create(
        model=model_name,
        prompt="Hello",
        max_tokens=8,
        temperature=0.0,
        extra_body={"min_tokens": 8, "stop_token_ids": [0]},
    )
    assert out.usage.completion_tokens == 8


def test_batch_token_id_prompts_and_echo(server, client, model_name: str) -> None:
    ids = httpx.post(
        f"{server.url}/tokenize", json={"prompt": PROMPT}, headers=server.headers, timeout=10
    ).json()
    ids = ids["tokens"]
    out = client.completions.create(model=model_name, prompt=[PROMPT, "Once upon"], **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    by_ids = client.completions.create(model=model_name, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == out.choices[0].text
    echo = client.completions.create(model=model_name, prompt=PROMPT, echo=True, **GREEDY)
    assert echo.choices[0].text == PROMPT + out.choices[0].text


def test_tokenize_and_detokenize_round_trip(server, model_name: str) -> None:
    tok = httpx.post(
        f"{server.url}/tokenize", json={"prompt": PROMPT}, headers=server.headers, timeout=10
    ).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
    back = httpx.post(
        f"{server.url}/detokenize",
        json={"tokens": tok["tokens"]},
        headers=server.headers,
        timeout=10,
    )
    assert back.json()["prompt"] == PROMPT
    chat = httpx.post(
        f"{server.url}/tokenize", json={"messages": CHAT}, headers=server.headers, timeout=10
    ).json()
    assert chat["count"] > tok["count"]


def test_metrics_use_vllm_names_under_pagoda_prefix(server, client, model_name: str) -> None:
    for _ in range(2):  # the second finds the first's prompt blocks in the prefix cache
        client.chat.completions.create(model=model_name, messages=CHAT, **GREEDY)
    m = server.metrics()
    for name in (
        "pagoda:num_requests_running",
        "pagoda:num_requests_waiting",
        "pagoda:kv_cache_usage_perc",
        "pagoda:prefix_cache_queries_total",
        "pagoda:prefix_cache_hits_total",
        "pagoda:prompt_tokens_total",
        "pagoda:generation_tokens_total",
        "pagoda:time_to_first_token_seconds_count",
        "pagoda:inter_token_latency_seconds_count",
        "pagoda:e2e_request_latency_seconds_count",
        "pagoda:request_queue_time_seconds_count",
    ):
        assert name in m, name
    assert m["pagoda:prompt_tokens_total"] > 0 and m["pagoda:generation_tokens_total"] > 0
    assert m["pagoda:time_to_first_token_seconds_count"] >= 1
    assert m["pagoda:prefix_cache_hits_total"] > 0


def test_v1_routes_need_the_api_key_and_health_does_not(server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
