"""Fixtures: one server (SmolLM2, CPU, with an API key) shared by the server tests."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from serverkit import Server


@pytest.fixture(scope="package")
def server() -> Iterator[Server]:
    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def model_name(server: Server) -> str:
    resp = httpx.get(f"{server.url}/v1/models", headers=server.headers, timeout=10)
    return resp.json()["data"][0]["id"]


@pytest.fixture(scope="package")
def client(server: Server):
    import openai

    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120
    )
