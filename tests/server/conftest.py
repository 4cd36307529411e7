"""Fixtures: one server (SmolLM2, CPU, with an API key) shared by the server tests."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="package")
def guarded_server() -> Iterator[Server]:
    """A server with a tiny admission limit (2 running, 2 waiting), a 1 MB body limit, request
    chat templates allowed (1 s deadline, 100,000 characters of output) and /metrics open."""
    srv = Server(
        "--max-num-seqs", "2", "--max-waiting-requests", "2",
        "--max-request-body-bytes", str(1_000_000),
        "--trust-request-chat-template",
        "--request-chat-template-timeout-s", "1",
        "--request-chat-template-max-chars", str(100_000),
        "--public-metrics",
    )  # fmt: skip
    yield srv
    srv.stop()


TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,  # SmolLM2's, so that its tokenizer and chat template fit
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="package")
def tiny_model(tmp_path_factory) -> Path:
    """A random two-layer Llama with SmolLM2's tokenizer and chat template (milliseconds a
    step on a CPU): for tests that need many requests, not good text."""
    from pagoda.loader import convert_gguf, default_model_path

    folder = tmp_path_factory.mktemp("tiny-llama")
    smollm2 = convert_gguf(default_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2 / name, folder / name)
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    return folder


@pytest.fixture(scope="package")
def tiny_server(tiny_model: Path) -> Iterator[Server]:
    """``pagoda serve`` of the tiny random model: 512 tokens of context, 256 running."""
    srv = Server(
        "--model", str(tiny_model), "--load-format", "dummy",
        "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
        engine_flags=False,
    )  # fmt: skip
    yield srv
    srv.stop()
