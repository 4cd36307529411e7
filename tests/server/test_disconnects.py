"""Clients that go away abort their requests and free their blocks; the others are unharmed."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

NUM_REQUESTS = 64
MAX_TOKENS = 8


def _wait_for_idle_engine(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (
            m["pagoda:num_requests_running"] == 0
            and m["pagoda:num_requests_waiting"] == 0
            and m["pagoda:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def _aborted(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("pagoda:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_64_streams_half_dropped_others_complete_and_blocks_are_freed(
    server, model_name: str
) -> None:
    aborted_before = _aborted(
        httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10).text
    )

    async def run() -> list[tuple[bool, str, int | None, str | None]]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=300
        )

        async def one(i: int) -> tuple[bool, str, int | None, str | None]:
            drop = i % 2 == 1
            stream = await client.chat.completions.create(
                model=model_name,
                messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}],
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, usage, finish = "", None, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
                if drop and text:
                    break  # mid-stream: some text came, more is on its way
            await stream.close()
            return drop, text, usage, finish

        try:
            return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
        finally:
            await client.close()

    results = asyncio.run(run())
    kept = [r for r in results if not r[0]]
    assert len(kept) == NUM_REQUESTS // 2
    for _, text, usage, finish in kept:
        assert text and usage == MAX_TOKENS and finish == "length"
    metrics = _wait_for_idle_engine(server)
    assert metrics["pagoda:kv_cache_usage_perc"] == 0
    assert metrics["pagoda:num_requests_running"] == 0
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10).text
    cut_short = sum(1 for drop, _, _, finish in results if drop and finish is None)
    assert cut_short > 0 and _aborted(text) - aborted_before == cut_short
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_non_streaming_client_that_leaves_aborts_its_request(server, model_name: str) -> None:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10).text
    aborted_before = _aborted(text)
    body = {
        "model": model_name,
        "prompt": "Tell me a long story.",
        "max_tokens": 400,
        "ignore_eos": True,
    }
    try:
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=1.5)
        raise AssertionError("a 400-token completion cannot finish in 1.5 s on a CPU")
    except httpx.ReadTimeout:
        pass  # the client gave up and closed the connection
    metrics = _wait_for_idle_engine(server, timeout=15)
    assert metrics["pagoda:num_requests_running"] == 0
    assert metrics["pagoda:kv_cache_usage_perc"] == 0
    assert (
        _aborted(httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10).text)
        == aborted_before + 1
    )
