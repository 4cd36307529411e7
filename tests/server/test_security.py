"""Security basics: the API key guards every route but /health (and /metrics only behind a flag)
and is compared in constant time; a client's request id is never trusted to be unique; nothing
but plain msgpack crosses the engine's sockets; the server listens on loopback unless told."""

from __future__ import annotations

import asyncio
import inspect

import httpx
import msgspec
import pytest

from pagoda.config import EngineConfig

GUARDED = [
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
    ("GET", "/metrics"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/no/such/route"),
]


@pytest.mark.parametrize(("method", "path"), GUARDED)
def test_every_route_but_health_needs_the_api_key(server, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer test-ke"}):
        resp = httpx.request(method, f"{server.url}{path}", headers=headers, timeout=10)
        assert resp.status_code == 401, (headers, resp.text)
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_metrics_are_open_only_behind_the_flag(guarded_server) -> None:
    # guarded_server runs with --public-metrics: scrapers need no key there, nothing else opens.
    assert httpx.get(f"{guarded_server.url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{guarded_server.url}/version", timeout=10).status_code == 401
    assert httpx.get(f"{guarded_server.url}/v1/models", timeout=10).status_code == 401


def test_the_api_key_is_compared_in_constant_time() -> None:
    from pagoda.entrypoints.openai import api_server

    source = inspect.getsource(api_server.build_app)
    assert "hmac.compare_digest(" in source
    assert '== f"Bearer' not in source and "api_key ==" not in source


def test_a_client_request_id_is_not_trusted_to_be_unique(server) -> None:
    body = {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True, "request_id": "same"}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers=server.headers, timeout=120) as client:
            url = f"{server.url}/v1/completions"
            return await asyncio.gather(*(client.post(url, json=body) for _ in range(4)))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    ids = [r.json()["id"] for r in responses]
    assert len(set(ids)) == 4 and all("same" in i for i in ids)


def test_only_plain_msgpack_crosses_the_engine_sockets(tiny_model) -> None:
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.sampling_params import SamplingParams

    overrides = {
        "model": str(tiny_model),
        "load_format": "dummy",
        "max_model_len": 128,
        "kv_cache_memory_bytes": 16 << 20,
    }
    llm = AsyncLLM(EngineConfig.load(overrides=overrides))
    frames: list[bytes] = []
    client = llm.client
    decoder, sock = client._decoder, client._in

    class Recording:
        def decode(self, buf):  # engine -> client
            frames.append(bytes(buf))
            return decoder.decode(buf)

    send = sock.send

    def recording_send(data, *args, **kwargs):  # client -> engine
        frames.append(bytes(data))
        return send(data, *args, **kwargs)

    client._decoder = Recording()
    sock.send = recording_send
    try:

        async def run() -> None:
            params = SamplingParams(max_tokens=4, logprobs=2, stop=["x"], n=2, seed=1)
            async for _ in llm.generate("Hello", params, "a"):
                pass
            gen = llm.generate("Hi", SamplingParams(max_tokens=50), "b")
            await gen.__anext__()
            await gen.aclose()  # an abort
            await llm.num_free_blocks()  # a utility call

        asyncio.run(run())
    finally:
        llm.shutdown()
    assert len(frames) >= 6
    for frame in frames:
        assert not frame.startswith(b"\x80"), "a pickle crossed an engine socket"
        msgspec.msgpack.decode(frame)  # any msgpack reader can read it: no pickle inside


def test_the_server_listens_on_loopback_unless_told() -> None:
    assert EngineConfig.load().server.host == "127.0.0.1"
