"""A huge prompt is tokenized off the event loop, so the server answers others meanwhile; a body
over the configured size is refused before it is read whole."""

from __future__ import annotations

import asyncio

import httpx

BIG_PROMPT = "The quick brown fox jumps over the lazy dog. " * (5_000_000 // 45)  # 5 MB


def test_health_and_a_small_request_are_answered_while_a_5mb_prompt_is_tokenized(server) -> None:
    order: list[str] = []

    async def run() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(headers=server.headers, timeout=300) as client:

            async def call(name: str, method: str, path: str, body: dict | None = None):
                resp = await client.request(method, server.url + path, json=body)
                order.append(name)
                return name, resp

            big = asyncio.create_task(
                call("big", "POST", "/v1/completions", {"prompt": BIG_PROMPT, "max_tokens": 4})
            )
            await asyncio.sleep(0.5)  # the body is in; its tokenizing takes seconds
            small = await asyncio.gather(
                call("health", "GET", "/health"),
                call("small", "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
            )
            return dict([*small, await big])

    responses = asyncio.run(run())
    assert order.index("big") == 2, order
    assert responses["health"].status_code == 200
    assert responses["small"].status_code == 200, responses["small"].text
    big = responses["big"]
    assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded"


def test_a_body_over_the_limit_is_refused_with_413(guarded_server) -> None:
    url = f"{guarded_server.url}/v1/completions"
    body = b'{"prompt": "' + b"a" * 2_000_000 + b'"}'
    declared = httpx.post(url, content=body, headers=guarded_server.headers, timeout=60)

    def chunks():
        for i in range(0, len(body), 65536):
            yield body[i : i + 65536]

    chunked = httpx.post(url, content=chunks(), headers=guarded_server.headers, timeout=60)
    for resp in (declared, chunked):
        assert resp.status_code == 413, resp.text
        error = resp.json()["error"]
        assert error["code"] == "request_too_large" and "1000000" in error["message"]
    small = (b'{"prompt": "Hi",', b' "max_tokens": 1}')
    headers = {**guarded_server.headers, "content-type": "application/json"}
    fits = httpx.post(url, content=iter(small), headers=headers, timeout=60)
    assert fits.status_code == 200, fits.text  # a chunked body under the limit reaches the route
