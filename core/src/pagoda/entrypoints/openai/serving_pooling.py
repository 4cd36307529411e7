"""The pooling endpoints: ``/v1/embeddings`` (OpenAI's shape), ``/score`` (vLLM's), ``/rerank``
(Jina's and Cohere's) and ``/classify``, over the engine's pooling requests.

Each input of a batch is one pooling request; a bad input is a 400 naming its field before any
of the batch runs, and a batch that fails part-way aborts the rest.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator

from pagoda.engine.core_client import EngineDeadError
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.limits import check_count
from pagoda.entrypoints.openai.protocol import _Body
from pagoda.entrypoints.openai.serving import Serving, new_id, now
from pagoda.outputs import PoolingRequestOutput
from pagoda.pooling.ops import cosine
from pagoda.pooling_params import PoolingParams

# ---- request bodies ----------------------------------------------------------------------------


class _PoolingBody(_Body):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = 0


class EmbeddingRequest(_PoolingBody):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None  # vLLM's extra


class ScoreRequest(_PoolingBody):
    text_1: str | list[str]
    text_2: str | list[str]
    activation: bool | None = None


class RerankRequest(_PoolingBody):
    query: str
    documents: list[str] | list[dict[str, str]]
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True

    @field_validator("documents")
    @classmethod
    def _texts(cls, value: list[Any]) -> list[Any]:
        for d in value:
            if isinstance(d, dict) and not isinstance(d.get("text"), str):
                raise ValueError("a document is a string or {'text': string}")
        return value

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d["text"] for d in self.documents]


class ClassifyRequest(_PoolingBody):
    input: str | list[str] | list[int] | list[list[int]]
    activation: bool | None = None


# ---- serving -----------------------------------------------------------------------------------

# A pooling error's message -> the request field it is about.
_FIELDS = (
    ("PoolingParams.dimensions", "dimensions"),
    ("PoolingParams.truncate_prompt_tokens", "truncate_prompt_tokens"),
    ("PoolingParams.task", "model"),
    ("PoolingParams.", None),
)


def _inputs(value: str | list[Any], name: str) -> list[Any]:
    """A batch of prompts: a string, or a token array (``prompt_token_ids``), each."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [value]
    else:
        items = list(value)
    if not items:
        raise APIError(f"`{name}` is empty: give at least one input", param=name)
    out = []
    for i, item in enumerate(items):
        if not item:
            raise APIError(f"`{name}` item {i} is empty: give some text or tokens", param=name)
        if isinstance(item, str):
            out.append({"prompt": item})
        else:
            out.append({"prompt_token_ids": list(item)})
    return out


class ServingPooling(Serving):
    def __init__(self, engine: Any, model_names: list[str]) -> None:
        super().__init__(engine, model_names)
        self.labels = _labels(engine.info.hf_dir)

    # ---- endpoints ---------------------------------------------------------------------------

    async def embeddings(self, req: EmbeddingRequest) -> dict[str, Any]:
        model = self.check_model(req.model)
        prompts = _inputs(req.input, "input")
        params = _params(
            task="embed",
            dimensions=req.dimensions,
            normalize=req.normalize,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        outs = await self._run("embd", prompts, params, req.priority, "input")
        data = []
        for i, o in enumerate(outs):
            vec = np.asarray(o.outputs.data, dtype=np.float32)
            emb: Any = (
                base64.b64encode(vec.astype("<f4").tobytes()).decode()
                if req.encoding_format == "base64"
                else vec.tolist()
            )
            data.append({"object": "embedding", "embedding": emb, "index": i})
        n = sum(len(o.prompt_token_ids) for o in outs)
        return {
            "id": new_id("embd", None),
            "object": "list",
            "created": now(),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }

    async def classify(self, req: ClassifyRequest) -> dict[str, Any]:
        model = self.check_model(req.model)
        prompts = _inputs(req.input, "input")
        params = _params(
            task="classify",
            activation=req.activation,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        outs = await self._run("classify", prompts, params, req.priority, "input")
        data = []
        for i, o in enumerate(outs):
            probs = np.asarray(o.outputs.data, dtype=np.float32).tolist()
            best = int(np.argmax(probs))
            label = self.labels.get(best, f"LABEL_{best}")
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        n = sum(len(o.prompt_token_ids) for o in outs)
        return {
            "id": new_id("classify", None),
            "object": "list",
            "created": now(),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }

    async def score(self, req: ScoreRequest) -> dict[str, Any]:
        model = self.check_model(req.model)
        firsts = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
        seconds = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
        if not firsts or not seconds:
            raise APIError("`text_1` and `text_2` need at least one text each",
                           param="text_1" if not firsts else "text_2")  # fmt: skip
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise APIError(
                f"`text_1` has {len(firsts)} texts for {len(seconds)} in `text_2`: give one, or "
                "one per text of `text_2`",
                param="text_1",
            )
        scores, n = await self._scores(firsts, seconds, req, req.activation)
        return {
            "id": new_id("score", None),
            "object": "list",
            "created": now(),
            "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }

    async def rerank(self, req: RerankRequest) -> dict[str, Any]:
        model = self.check_model(req.model)
        docs = req.texts()
        if not docs:
            raise APIError("`documents` is empty: give at least one document", param="documents")
        scores, n = await self._scores([req.query] * len(docs), docs, req, None)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        if req.top_n is not None:
            order = order[: req.top_n]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                item["document"] = {"text": docs[i]}
            results.append(item)
        return {
            "id": new_id("rerank", None),
            "model": model,
            "usage": {"prompt_tokens": n, "total_tokens": n},
            "results": results,
        }

    # ---- running -----------------------------------------------------------------------------

    async def _scores(
        self, firsts: list[str], seconds: list[str], req: _PoolingBody, activation: bool | None
    ) -> tuple[list[float], int]:
        """A cross-encoder's scores of the pairs where the model has one; else the cosine of the
        embeddings (a bi-encoder). Returns the scores and the prompt tokens run."""
        truncate = req.truncate_prompt_tokens
        if "score" in self.engine.info.tasks:
            params = _params(task="score", activation=activation, truncate_prompt_tokens=truncate)
            pairs = list(zip(firsts, seconds))
            outs = await self._run("score", pairs, params, req.priority, "text_1")
            n = sum(len(o.prompt_token_ids) for o in outs)
            return [float(np.asarray(o.outputs.data)[0]) for o in outs], n
        texts = list(dict.fromkeys(firsts + seconds))
        params = _params(task="embed", truncate_prompt_tokens=truncate)
        outs = await self._run(
            "score", [{"prompt": t} for t in texts], params, req.priority, "text_1"
        )
        by_text = {t: o for t, o in zip(texts, outs)}

        def vec(t: str) -> torch.Tensor:
            return torch.from_numpy(np.asarray(by_text[t].outputs.data))

        scores = [cosine(vec(a), vec(b)) for a, b in zip(firsts, seconds)]
        return scores, sum(len(o.prompt_token_ids) for o in outs)

    async def _run(
        self,
        prefix: str,
        prompts: list[Any],
        params: PoolingParams,
        priority: int,
        field: str,
    ) -> list[PoolingRequestOutput]:
        """Submit every prompt (validated all first) and wait for all their outputs."""
        check_count(field, len(prompts), self.limits.max_prompts_per_request,
                    "max_prompts_per_request")  # fmt: skip
        rid = new_id(prefix, None)
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                request_id = f"{rid}-{i}"
                try:
                    stream = self.engine.add_pooling_request(
                        request_id, prompt, params, priority=priority
                    )
                except EngineDeadError as e:
                    raise APIError(f"the engine is not running: {e}", 503) from e
                except (ValueError, TypeError) as e:
                    raise _bad_pooling(e, field) from e
                streams.append((request_id, stream))
            results = await asyncio.gather(
                *(self._one(request_id, stream) for request_id, stream in streams)
            )
        except BaseException as e:
            for request_id, _ in streams:
                self.engine.abort(request_id)
            if isinstance(e, Exception):
                raise self.error_of(e) from e
            raise
        return results

    async def _one(self, request_id: str, stream: Any) -> PoolingRequestOutput:
        async for out in self.engine.stream(request_id, stream):
            if out.finished:
                if out.outputs.data is None:
                    raise APIError(f"request {request_id} ended without an output", 500)
                return out
        raise APIError(f"request {request_id} ended without an output", 500)


def _params(**fields: Any) -> PoolingParams:
    """The request's pooling parameters; a value they refuse is a 400 naming its field."""
    try:
        return PoolingParams(**fields)
    except ValueError as e:
        raise _bad_pooling(e, "input") from e


def _bad_pooling(e: ValueError | TypeError, input_field: str) -> APIError:
    msg = str(e)
    for prefix, field in _FIELDS:
        if msg.startswith(prefix):
            return APIError(msg, param=field)
    code = "context_length_exceeded" if re.search(r"context is \d+", msg) else None
    return APIError(msg, param=input_field, code=code)


def _labels(hf_dir: str) -> dict[int, str]:
    """A classifier's label names (config.json's ``id2label``)."""
    path = Path(hf_dir) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {int(k): str(v) for k, v in (data.get("id2label") or {}).items()}
