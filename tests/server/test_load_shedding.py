"""A request the engine sheds (scheduler.max_waiting_requests) gets a 429 in OpenAI's error shape,
with Retry-After, before any body is sent: on every entry point, streaming or not, n > 1."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

MESSAGES = [{"role": "user", "content": "Write a long story about a cat."}]


def _request(i: int) -> tuple[str, dict]:
    stream = i % 2 == 0
    n = 2 if i % 4 in (0, 1) else 1
    body = {"max_tokens": 24, "ignore_eos": True, "stream": stream, "n": n}
    if i % 8 < 4:
        return "/v1/completions", {**body, "prompt": f"Once upon a time {i}"}
    return "/v1/chat/completions", {**body, "messages": MESSAGES}


async def _one(client: httpx.AsyncClient, url: str, i: int) -> dict:
    path, body = _request(i)
    async with client.stream("POST", url + path, json=body) as resp:
        raw = (await resp.aread()).decode()
    return {"i": i, "path": path, "body": body, "status": resp.status_code,
            "headers": resp.headers, "raw": raw}  # fmt: skip


def _wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["pagoda:num_requests_running"] == m["pagoda:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


def test_16_concurrent_requests_get_only_200s_and_429s(guarded_server) -> None:
    async def run() -> list[dict]:
        async with httpx.AsyncClient(headers=guarded_server.headers, timeout=120) as client:
            return await asyncio.gather(*(_one(client, guarded_server.url, i) for i in range(16)))

    results = asyncio.run(run())
    statuses = sorted(r["status"] for r in results)
    assert set(statuses) <= {200, 429}, [(r["i"], r["status"], r["raw"][:200]) for r in results]
    assert 200 in statuses and 429 in statuses, statuses
    kinds = set()
    for r in results:
        stream, n = r["body"]["stream"], r["body"]["n"]
        if r["status"] == 429:
            kinds.add((r["path"], stream, n))
            # Decided before any body: a JSON error, not an event stream.
            assert r["headers"]["content-type"] == "application/json", r
            assert int(r["headers"]["retry-after"]) >= 0
            error = json.loads(r["raw"])["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "request_rejected"
            assert set(error) == {"message", "type", "param", "code"}
        elif stream:
            assert r["headers"]["content-type"].startswith("text/event-stream")
            events = [e.removeprefix("data: ") for e in r["raw"].split("\n\n") if e]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), r["raw"]
        else:
            body = json.loads(r["raw"])
            assert len(body["choices"]) == n
            assert all(c["finish_reason"] == "length" for c in body["choices"])
    # A shed streaming request, as any other, is turned away before its stream starts.
    assert any(stream for _, stream, _ in kinds), kinds
    m = _wait_idle(guarded_server)
    assert m["pagoda:kv_cache_usage_perc"] == 0
