"""Schemathesis over the server's own OpenAPI document: every operation it lists gets requests
generated from its schema, valid ones (positive) and ones that break it (negative: wrong types,
out-of-range values, missing or mangled bodies, a wrong API key), and every answer is checked
against the document: no 5xx, a documented status and media type, a body of the documented shape
(every error OpenAI's ``{"error": {...}}``), the API key enforced. Every method a path does not
list gets a 405 in OpenAI's shape.

Two of schemathesis's checks are left out. "Schema-valid requests are accepted": some refusals
depend on the model and the tokenizer, which no schema can hold (a prompt and ``max_tokens``
past the context, ``min_tokens`` above ``max_tokens``, a grammar that does not compile).
"Schema-breaking requests are refused": the server reads JSON values as pydantic's lax mode
does, as vLLM's does (``true`` where an integer is due reads as 1, ``"5"`` as 5), which the
document's types do not say.

Seeded and bounded: ``PAGODA_FUZZ_CASES // 20`` cases for each operation and mode (50 by
default, ~700 in all; ``PAGODA_FUZZ_CASES=10000`` for a long run). Valid requests are capped to
a few output tokens and sequences so that a case costs milliseconds on the tiny model.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

PER_OPERATION = max(1, int(os.environ.get("PAGODA_FUZZ_CASES", "1000")) // 20)
GENERATING = ("/v1/completions", "/v1/chat/completions")
# Caps on a valid request's work (each within the schema's bounds, so a case stays valid).
MAX_OUTPUT_TOKENS = 4
MAX_SEQUENCES = 2
MAX_BATCH = 4


@pytest.fixture(scope="module", autouse=True)
def _hypothesis_as_it_was() -> Iterator[None]:
    """Schemathesis's first strategy patches hypothesis's globals (a larger buffer, no printing
    of falsifying examples) for the whole process; put them back after this module, so that the
    other hypothesis tests run as they do without schemathesis installed (its pytest plugin is
    off, ``-p no:schemathesis`` in pyproject.toml, for the same reason)."""
    from hypothesis import core
    from hypothesis.internal import entropy
    from hypothesis.internal.conjecture import engine
    from hypothesis.strategies._internal import collections as hcollections
    from hypothesis.strategies._internal import core as score
    from schemathesis.generation.hypothesis import setup

    patched = [
        (core, "RepresentationPrinter"), (core, "BUFFER_SIZE"), (engine, "BUFFER_SIZE"),
        (hcollections, "BUFFER_SIZE"), (score, "is_first_param_referenced_in_function"),
        (entropy, "register_random"),
    ]  # fmt: skip
    saved = [(obj, name, getattr(obj, name)) for obj, name in patched]
    yield
    for obj, name, value in saved:
        setattr(obj, name, value)
    setup._is_patched = False  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def document(tiny_server) -> dict[str, Any]:
    resp = httpx.get(f"{tiny_server.url}/openapi.json", headers=tiny_server.headers, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_document_lists_what_the_server_answers(tiny_server, document) -> None:
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # FastAPI's 422, which this server never sends
    paths = document["paths"]
    assert set(paths) >= {
        "/health", "/metrics", "/version", "/v1/models",
        "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
    }  # fmt: skip
    for path, operations in paths.items():
        for method, op in operations.items():
            where = f"{method.upper()} {path}"
            assert "422" not in op["responses"], where
            errors = [code for code in op["responses"] if code >= "400"]
            assert errors, where
            for code in errors:
                ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/ErrorResponse", where
            assert ("security" in op) == (path != "/health"), where
            if method == "post":
                body = op["requestBody"]["content"]["application/json"]["schema"]
                assert schemas[body["$ref"].rsplit("/", 1)[1]]["properties"], where
    props = schemas["CompletionRequest"]["properties"]
    token_ids = props["prompt"]["anyOf"][2]["items"]
    assert token_ids["maximum"] == 49151  # the tiny model's vocabulary
    assert props["suffix"]["enum"] == [None]  # refused unless absent
    model = next(b for b in props["model"]["anyOf"] if b.get("type") == "string")
    served = httpx.get(f"{tiny_server.url}/v1/models", headers=tiny_server.headers).json()
    assert model["enum"] == [m["id"] for m in served["data"]]
    stop = next(b for b in props["stop"]["anyOf"] if b.get("type") == "array")
    assert stop["maxItems"] == 64 and stop["items"]["maxLength"] == 1024  # server.* defaults


def _bound_work(case: schemathesis.Case) -> None:
    """Cap a valid request's output tokens, sequences and batch (within the schema's bounds)."""
    body = case.body
    if case.operation.path not in GENERATING or not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int):
            body[key] = min(body[key], MAX_OUTPUT_TOKENS)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens" if "messages" in body else "max_tokens"] = MAX_OUTPUT_TOKENS
    for key in ("n", "best_of"):
        if isinstance(body.get(key), int):
            body[key] = min(body[key], MAX_SEQUENCES)
    if isinstance(body.get("prompt"), list) and not isinstance(body["prompt"][0], int):
        body["prompt"] = body["prompt"][:MAX_BATCH]


def _operations(document: dict[str, Any], api_key: str) -> list[Any]:
    """The document's operations; schemathesis sends the key (valid requests) or leaves it out
    or mangles it (some invalid ones), as the document's bearer scheme says."""
    config = schemathesis.Config.from_dict({"auth": {"openapi": {"bearer": {"bearer": api_key}}}})
    schema = schemathesis.openapi.from_dict(document, config=config)
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz(op: Any, mode: GenerationMode, url: str, seen: list[int]) -> None:
    """``PER_OPERATION`` cases of ``op`` in ``mode``, sent and checked; statuses to ``seen``."""
    label = f"{op.method.upper()} {op.path} {mode.value}"

    @settings(
        max_examples=PER_OPERATION,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(mode))
    def one(case: schemathesis.Case) -> None:
        if mode is GenerationMode.POSITIVE:
            _bound_work(case)
        resp = case.call(base_url=url, timeout=120)
        seen.append(resp.status_code)
        case.validate_response(
            resp,
            excluded_checks=[positive_data_acceptance, negative_data_rejection],
            transport_kwargs={"base_url": url},
        )
        if resp.status_code >= 400:  # beyond the schema: a message that says something
            assert resp.json()["error"]["message"].strip(), label

    try:
        one()
    except Exception as e:  # an operation without parameters has no negative case
        if type(e).__name__ != "Unsatisfiable" or mode is GenerationMode.POSITIVE:
            raise


def test_generated_requests_conform_to_the_document(tiny_server, document) -> None:
    counts: dict[str, list[int]] = {}
    took: dict[str, float] = {}
    for op in _operations(document, tiny_server.api_key):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            label = f"{op.method.upper()} {op.path} {mode.value}"
            start = time.monotonic()
            _fuzz(op, mode, tiny_server.url, counts.setdefault(label, []))
            took[label] = time.monotonic() - start
    statuses = collections.Counter(s for seen in counts.values() for s in seen)
    print(
        f"{statuses.total()} schema cases in {sum(took.values()):.1f} s: "
        f"{dict(sorted(statuses.items()))}"
    )
    for label, seen in sorted(counts.items()):
        print(f"  {label}: {len(seen)} in {took[label]:.1f} s")
    # Every operation was exercised with valid requests, and the POSTs with invalid ones too.
    for path, operations in document["paths"].items():
        for method in operations:
            assert counts[f"{method.upper()} {path} positive"], (method, path)
            if method == "post":
                assert len(counts[f"{method.upper()} {path} negative"]) >= PER_OPERATION // 2
    assert statuses[200] >= PER_OPERATION and statuses[400] >= PER_OPERATION, statuses
    assert not [s for s in statuses if s >= 500], statuses
    m = tiny_server.wait_idle()
    assert m["pagoda:num_requests_running"] == 0 and m["pagoda:kv_cache_usage_perc"] == 0, m


METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")


def test_a_method_a_path_does_not_list_is_a_405_in_openai_shape(tiny_server, document) -> None:
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=30) as c:
        for path, operations in document["paths"].items():
            for method in METHODS:
                if method.lower() in operations:
                    continue
                resp = c.request(method, path, content=b"{}")
                where = f"{method} {path}: {resp.status_code} {resp.text[:200]}"
                assert resp.status_code == 405, where
                error = resp.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, where
                assert error["message"], where


def test_a_top_p_that_rounds_to_zero_is_answered_and_the_engine_lives(tiny_server) -> None:
    """Found by the long run: ``top_p: 5e-324`` is > 0 as the API checks it and 0 in the
    sampler's float32, where it made the step fail, which ends the engine (every request 503)."""
    body = {"prompt": "Hello", "max_tokens": 2, "top_p": 5e-324, "temperature": 1.0}
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=60) as c:
        for stream in (False, True):
            resp = c.post("/v1/completions", json={**body, "stream": stream})
            assert resp.status_code == 200, resp.text
            assert "error" not in resp.text, resp.text
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("field", ["priority", "top_k"])
@pytest.mark.parametrize("value", [2**70, -(2**70)])
def test_an_integer_past_64_bits_is_a_400_naming_the_field(tiny_server, field, value) -> None:
    """Found by the long run: such a ``priority`` (or ``top_k``) reached the engine's wire, which
    carries 64-bit integers, and the request got a 500."""
    body = {"prompt": "Hello", "max_tokens": 2, field: value}
    resp = httpx.post(
        f"{tiny_server.url}/v1/completions", json=body, headers=tiny_server.headers, timeout=60
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field
