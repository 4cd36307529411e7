"""LoRA through ``pagoda serve``: adapters of --lora-modules, loaded at run time and found by the
local resolver are models in /v1/models, selected by ``model``; bad adapters and unknown names
get a 4xx naming them, and nothing else fails; the adapters' metrics."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import httpx
import pytest
import torch

# NOTE: the server tests' helper that starts a real ``pagoda serve`` (tests/server/serverkit.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serverkit import Server  # noqa: E402

PROMPT = [1, 17, 301, 45, 12, 99, 230, 7]


@pytest.fixture(scope="module")
def lora_server(lora_model, tmp_path_factory):
    resolver_dir = tmp_path_factory.mktemp("resolvable")
    shutil.copytree(lora_model["paths"]["lora-b"], resolver_dir / "found-b")
    srv = Server(
        "--model", str(lora_model["base"]), "--dtype", "float32", "--max-model-len", "256",
        "--kv-cache-memory-bytes", str(16 << 20), "--enable-lora", "--max-loras", "2",
        "--lora-modules", f"lora-a={lora_model['paths']['lora-a']}",
        "--allow-runtime-lora-updating", "--resolvers", "local",
        "--resolver-dir", str(resolver_dir), "--public-metrics",
        engine_flags=False,
    )  # fmt: skip
    yield srv
    srv.stop()


def _complete(srv: Server, model: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1}  # fmt: skip
    return httpx.post(f"{srv.url}/v1/completions", json=body, headers=srv.headers, timeout=60)


def _hf_text(lora_model, name: str | None, n: int = 4) -> str:
    from transformers import AutoTokenizer

    ids = list(PROMPT)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(lora_model["hf"][name](torch.tensor([ids])).logits[0, -1].argmax()))
    tok = AutoTokenizer.from_pretrained(str(lora_model["base"]))
    return tok.decode(ids[len(PROMPT) :], skip_special_tokens=True)


def _models(srv: Server) -> dict[str, dict]:
    resp = httpx.get(f"{srv.url}/v1/models", headers=srv.headers, timeout=10)
    return {m["id"]: m for m in resp.json()["data"]}


def test_adapters_are_models_selected_by_name(lora_server, lora_model) -> None:
    models = _models(lora_server)
    base = next(name for name, m in models.items() if m["parent"] is None)
    assert models["lora-a"]["parent"] == base
    assert models["lora-a"]["root"] == str(lora_model["paths"]["lora-a"])
    resp = _complete(lora_server, "lora-a")
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "lora-a"
    assert resp.json()["choices"][0]["text"].strip() == _hf_text(lora_model, "lora-a")
    base_resp = _complete(lora_server, base)
    assert base_resp.json()["choices"][0]["text"].strip() == _hf_text(lora_model, None)
    assert base_resp.json()["choices"][0]["text"] != resp.json()["choices"][0]["text"]


def test_the_openapi_document_has_the_adapter_routes(lora_server) -> None:
    doc = httpx.get(f"{lora_server.url}/openapi.json", headers=lora_server.headers, timeout=30)
    assert doc.status_code == 200, doc.text
    paths = doc.json()["paths"]
    assert "/v1/load_lora_adapter" in paths and "/v1/unload_lora_adapter" in paths


def test_an_unknown_model_name_is_a_404_naming_it(lora_server) -> None:
    resp = _complete(lora_server, "no-such-adapter")
    assert resp.status_code == 404
    msg = resp.json()["error"]["message"]
    assert "`no-such-adapter`" in msg and "\n" not in msg


def test_the_local_resolver_finds_an_adapter_by_name(lora_server, lora_model) -> None:
    resp = _complete(lora_server, "found-b")
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"].strip() == _hf_text(lora_model, "lora-b")
    assert "found-b" in _models(lora_server)


def test_load_and_unload_at_run_time_and_bad_adapters(lora_server, lora_model, tmp_path) -> None:
    url, h = lora_server.url, lora_server.headers
    path = str(lora_model["paths"]["lora-b"])
    resp = httpx.post(f"{url}/v1/load_lora_adapter", headers=h, timeout=30,
                      json={"lora_name": "late-b", "lora_path": path})  # fmt: skip
    assert resp.status_code == 200, resp.text
    text = _complete(lora_server, "late-b").json()["choices"][0]["text"]
    assert text.strip() == _hf_text(lora_model, "lora-b")
    big = tmp_path / "big"
    shutil.copytree(path, big)
    cfg = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**cfg, "r": 32}))
    for name, where, words in [
        ("late-b", path, "already loaded"),
        ("gone", str(tmp_path / "nowhere"), "no such folder"),
        ("big", str(big), "rank 32 is above lora.max_lora_rank=16"),
    ]:
        resp = httpx.post(f"{url}/v1/load_lora_adapter", headers=h, timeout=30,
                          json={"lora_name": name, "lora_path": where})  # fmt: skip
        assert resp.status_code == 400, resp.text
        msg = resp.json()["error"]["message"]
        assert f"'{name}'" in msg and words in msg and "\n" not in msg, msg
    resp = httpx.post(f"{url}/v1/unload_lora_adapter", headers=h, timeout=30,
                      json={"lora_name": "late-b"})  # fmt: skip
    assert resp.status_code == 200
    assert _complete(lora_server, "late-b").status_code == 404
    resp = httpx.post(f"{url}/v1/unload_lora_adapter", headers=h, timeout=30,
                      json={"lora_name": "late-b"})  # fmt: skip
    assert resp.status_code == 404
    assert _complete(lora_server, "lora-a").status_code == 200  # nothing else failed


def test_adapter_metrics_name_the_running_and_waiting_adapters(lora_server) -> None:
    _complete(lora_server, "lora-a", max_tokens=2)
    text = httpx.get(f"{lora_server.url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("pagoda:lora_requests_info{")]
    assert lines and 'max_lora="2"' in lines[0], text[-2000:]
