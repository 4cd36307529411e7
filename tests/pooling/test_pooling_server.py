"""``pagoda serve`` with pooling models: ``/v1/embeddings`` through the official ``openai``
client (float and base64, strings, token arrays, batches, ``dimensions``), ``/rerank`` and
``/score`` ordered as transformers' cross-encoder scores, ``/classify``, and bad input answered
with a 400 naming its field while the server keeps serving."""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from pooling_models import TEXTS, bert_config, randomize, save_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serverkit import Server  # noqa: E402

FLAGS = ("--max-model-len", "128", "--kv-cache-memory-bytes", str(64 << 20), "--block-size", "16")


@pytest.fixture(scope="module")
def embed_server(st_dirs) -> Iterator[tuple[Server, Path]]:
    folder = st_dirs("qwen3", "lasttoken", True)
    srv = Server(str(folder), *FLAGS, engine_flags=False)
    yield srv, folder
    srv.stop()


@pytest.fixture(scope="module")
def cross_encoder(pool_dir: Path):
    from transformers import BertForSequenceClassification

    # Small weights: scores spread inside (0, 1), none saturates to a tie with another.
    model = randomize(BertForSequenceClassification(bert_config(num_labels=1)), 5, scale=0.08)
    return model, save_hf(model, pool_dir / "ce_server", pool_dir / "tok")


@pytest.fixture(scope="module")
def score_server(cross_encoder) -> Iterator[Server]:
    srv = Server(str(cross_encoder[1]), *FLAGS, engine_flags=False)
    yield srv
    srv.stop()


def _client(srv: Server):
    import openai

    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=60)


def _st(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)


def test_openai_client_embeddings_float_and_base64_match_sentence_transformers(
    embed_server,
) -> None:
    srv, folder = embed_server
    client = _client(srv)
    want = _st(folder, TEXTS)
    for fmt in ("float", "base64"):
        resp = client.embeddings.create(model=folder.name, input=TEXTS, encoding_format=fmt)
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        if fmt == "base64":  # asked for explicitly, the client hands the text over as is
            got = np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in resp.data])
        else:
            got = np.array([d.embedding for d in resp.data], dtype=np.float32)
        assert np.abs(got - want).max() < 1e-4
        assert resp.usage.prompt_tokens == resp.usage.total_tokens > len(TEXTS)
    # The client's default asks for base64 and decodes it.
    one = client.embeddings.create(model=folder.name, input=TEXTS[0])
    assert np.abs(np.array(one.data[0].embedding) - want[0]).max() < 1e-4


def test_embeddings_of_token_arrays_and_dimensions(embed_server) -> None:
    srv, folder = embed_server
    client = _client(srv)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(folder))(TEXTS[1])["input_ids"]
    by_ids = client.embeddings.create(model=folder.name, input=[ids, ids], encoding_format="float")
    by_text = client.embeddings.create(model=folder.name, input=TEXTS[1], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, by_text.data[0].embedding, atol=1e-5)
    short = client.embeddings.create(
        model=folder.name, input=TEXTS[1], dimensions=8, encoding_format="float"
    )
    vec = np.array(short.data[0].embedding)
    assert vec.shape == (8,) and abs(np.linalg.norm(vec) - 1.0) < 1e-5


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": "w1 " * 200}, "input"),
        ({"input": "hello", "dimensions": 4096}, "dimensions"),
        ({"input": [[1, 2, 10**6]]}, "input"),
        ({"input": "hello", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_bad_embedding_input_is_a_400_naming_the_field(embed_server, body, param) -> None:
    srv, folder = embed_server
    resp = httpx.post(f"{srv.url}/v1/embeddings", json={"model": folder.name, **body},
                      headers=srv.headers, timeout=30)  # fmt: skip
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_truncation_when_asked_and_the_wrong_task_refused(embed_server) -> None:
    srv, folder = embed_server
    long = {"model": folder.name, "input": "w1 " * 200, "truncate_prompt_tokens": 50}
    resp = httpx.post(f"{srv.url}/v1/embeddings", json=long, headers=srv.headers, timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == 50
    # An embedding model has no classifier, and generates nothing.
    resp = httpx.post(f"{srv.url}/classify", json={"input": "hello"}, headers=srv.headers)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
    resp = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                      headers=srv.headers, timeout=30)  # fmt: skip
    assert resp.status_code == 400 and "not generation" in resp.json()["error"]["message"]
    # ... and still serves.
    ok = _client(srv).embeddings.create(model=folder.name, input="dog", encoding_format="float")
    assert len(ok.data[0].embedding) == 64


def test_rerank_orders_documents_as_transformers_scores_them(cross_encoder, score_server) -> None:
    from transformers import BertTokenizerFast

    model, folder = cross_encoder
    srv = score_server
    query, docs = "what is the capital of france", TEXTS
    tok = BertTokenizerFast.from_pretrained(str(folder))
    with torch.no_grad():
        batch = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
        want = torch.sigmoid(model(**batch).logits[:, 0]).numpy()
    body = {"query": query, "documents": docs, "top_n": 4}
    resp = httpx.post(f"{srv.url}/rerank", json=body, headers=srv.headers, timeout=30)
    assert resp.status_code == 200, resp.text
    results = resp.json()["results"]
    assert np.diff(np.sort(want)).min() > 1e-4  # distinct: the order is well defined
    assert [r["index"] for r in results] == [int(i) for i in np.argsort(-want)[:4]]
    assert all(abs(r["relevance_score"] - want[r["index"]]) < 1e-4 for r in results)
    assert results[0]["document"]["text"] == docs[results[0]["index"]]
    body = {"text_1": query, "text_2": docs}
    scores = httpx.post(f"{srv.url}/score", json=body, headers=srv.headers, timeout=30).json()
    assert np.abs(np.array([d["score"] for d in scores["data"]]) - want).max() < 1e-4
    cls = httpx.post(f"{srv.url}/classify", json={"input": docs[:2]}, headers=srv.headers)
    assert cls.status_code == 200 and cls.json()["data"][0]["num_classes"] == 1
    bad = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "x"}, headers=srv.headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
