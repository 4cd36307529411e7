"""``pagoda serve`` with the tiny Qwen2.5-VL: the official ``openai`` client sends an image as a
data URI in a chat message and gets an answer, streamed too; bad images are 400s that name the
problem, and the engine serves on after each."""

from __future__ import annotations

import base64
import io
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from vl_tiny import hf_model, image, save

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests" / "server"))
from serverkit import Server  # noqa: E402


def _data_uri(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    image(56, 56, 7).save(root / "cat.png")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, media: Path):
    folder = save(hf_model(), tmp_path_factory.mktemp("qwen2_5_vl_serve"))
    srv = Server(
        "--model", str(folder), "--dtype", "float32", "--max-model-len", "256",
        "--kv-cache-memory-bytes", str(16 << 20), "--max-num-batched-tokens", "16",
        "--max-num-encoder-input-tokens", "64", "--limit-mm-per-prompt", '{"image": 2}',
        "--allowed-local-media-path", str(media), engine_flags=False,
    )  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0,
                         timeout=60)  # fmt: skip


def _messages(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [{"type": "text", "text": "t50 t51 "}, *parts]}]


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_openai_client_sends_an_image_as_a_data_uri_and_gets_an_answer(client):
    resp = client.chat.completions.create(
        model=_model(client), messages=_messages(_data_uri(image(84, 56, 1))), max_tokens=5,
        temperature=0.0,
    )  # fmt: skip
    assert resp.choices[0].message.content
    # t3, two words, vision start, the image's 6 tokens, vision end, t4, t5
    assert resp.usage.prompt_tokens == 13


def test_streaming_with_an_image_gives_the_same_answer(client):
    messages = _messages(_data_uri(image(84, 112, 2)))
    whole = client.chat.completions.create(
        model=_model(client), messages=messages, max_tokens=5, temperature=0.0
    )
    chunks = client.chat.completions.create(
        model=_model(client), messages=messages, max_tokens=5, temperature=0.0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_a_local_file_under_the_allowed_root_is_read(client, media: Path):
    resp = client.chat.completions.create(
        model=_model(client), messages=_messages(f"file://{media / 'cat.png'}"), max_tokens=3
    )
    assert resp.choices[0].message.content


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n not a png").decode(),
         "cannot be decoded"),
        ("ftp://example.com/cat.png", "unsupported URL scheme"),
        ("https://example.com/cat.png", "fetching http(s) URLs is off"),
        ("file:///etc/passwd", "outside allowed_local_media_path"),
    ],
)  # fmt: skip
def test_bad_image_is_a_400_naming_it_and_the_engine_serves_on(client, server, url, named):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=_model(client), messages=_messages(url),
                                       max_tokens=3)  # fmt: skip
    assert named in str(e.value)
    ok = client.chat.completions.create(
        model=_model(client), messages=_messages(_data_uri(image(56, 56, 3))), max_tokens=2
    )
    assert ok.choices[0].message.content is not None
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_too_many_images_is_a_400_naming_the_limit(client):
    uri = _data_uri(image(56, 56, 4))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=_model(client), messages=_messages(uri, uri, uri),
                                       max_tokens=3)  # fmt: skip
    assert "limit_mm_per_prompt" in str(e.value)


def test_metrics_count_encoder_cache_lookups_and_hits(client, server):
    uri = _data_uri(image(56, 84, 5))
    queries, hits = "pagoda:encoder_cache_queries_total", "pagoda:encoder_cache_hits_total"
    before = server.metrics()
    for words in ("t50 t51 ", "t60 t61 "):  # different text before it: no prefix-cache hit
        parts = [{"type": "text", "text": words}, {"type": "image_url", "image_url": {"url": uri}}]
        messages = [{"role": "user", "content": parts}]
        client.chat.completions.create(model=_model(client), messages=messages, max_tokens=1)
    deadline = time.monotonic() + 10
    while True:  # the stats reach /metrics with the engine's next report
        after = server.metrics()
        if after[queries] - before[queries] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after[queries] - before[queries] == 2
    assert after[hits] - before[hits] == 1


def test_openapi_document_takes_image_url_parts_for_a_vision_model(server):
    doc = httpx.get(f"{server.url}/openapi.json", headers=server.headers, timeout=10).json()
    content = doc["components"]["schemas"]["ChatMessage"]["properties"]["content"]
    items = [b["items"] for b in content.get("anyOf", [content]) if b.get("type") == "array"]
    kinds = [part["properties"]["type"]["const"] for part in items[0]["anyOf"]]
    assert kinds == ["text", "image_url"]
