"""The server's OpenAPI document (``GET /openapi.json``), as the server really answers.

FastAPI's own document describes a 422 with its validation-error body, which this server never
sends; it knows nothing of the limits, the served model names or the vocabulary, and it leaves
the answers' bodies undescribed. Here the document is made to say what a client gets:

- every error as OpenAI's ``{"error": {"message", "type", "param", "code"}}``, under the status
  codes each route can answer with (400, 401, 404, 413, 429, 503);
- each 200 body's shape, and its media type (JSON, server-sent events, Prometheus text);
- the request fields' real bounds: token ids below the vocabulary size, the served model
  names, the ``server.*`` limits on stop strings, ``logit_bias``, prompts and messages, text
  parts (and, for a model that reads images, image_url parts) in message content, and the fields
  OpenAI defines that this server refuses;
- the bearer token every route but ``/health`` requires (and ``/metrics`` when public).

What no schema can hold (a prompt that does not fit the context, a grammar that does not
compile) stays a 400 the document lists but cannot predict.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagoda.config.model import ServerConfig
from pagoda.entrypoints.openai.protocol import _UNSUPPORTED

_ERROR = {
    "type": "object",
    "description": "OpenAI's error body",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "additionalProperties": False,
            "properties": {
                "message": {"type": "string", "minLength": 1},
                "type": {"type": "string", "minLength": 1},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_WHY = {
    "400": "the request is invalid (the message names the field)",
    "401": "a missing or wrong API key",
    "404": "a model this server does not serve",
    "413": "the request body is larger than `server.max_request_body_bytes`",
    "429": "the server is full or an admission rule turned the request away; retry after "
    "`Retry-After` seconds",
    "503": "the engine stopped, or the server is shutting down",
}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        k: {"type": "integer", "minimum": 0}
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}
_FINISH = {"type": ["string", "null"]}
_LOGPROBS = {"type": ["object", "null"]}


def _body(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        },
    }


_COMPLETION = _body(
    "text_completion",
    {
        "type": "object",
        "required": ["index", "text", "logprobs", "finish_reason"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "text": {"type": "string"},
            "logprobs": _LOGPROBS,
            "finish_reason": _FINISH,
        },
    },
)
_CHAT = _body(
    "chat.completion",
    {
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "message": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"type": ["string", "null"]},
                },
            },
            "logprobs": _LOGPROBS,
            "finish_reason": _FINISH,
        },
    },
)
_SSE = {
    "schema": {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string", "minLength": 1}},
    },
    "description": "with `stream`: server-sent events, one chunk each, ending with `data: [DONE]`",
}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "additionalProperties": False,
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_IMAGE_PART = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "type": "object",
            "required": ["url"],
            "properties": {"url": {"type": "string", "minLength": 1}},
        },
    },
    "description": "a vision-language model's image: a data URI, a file under"
    " allowed_local_media_path, or http(s) when allow_remote_media is on",
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _ok(path: str) -> dict[str, Any]:
    """The 200 answer of each route."""
    ints = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    string = {"type": "string"}
    answers: dict[str, dict[str, Any]] = {
        "/health": {
            "description": "the engine is up (no body); a 503 names what stopped, such as one"
            " data-parallel core while the others serve on"
        },
        "/metrics": {
            "description": "Prometheus metrics",
            "content": {"text/plain": {"schema": string}},
        },
        "/version": {
            "description": "the server's version, model and hardware",
            "content": _json(
                {
                    "type": "object",
                    "required": ["version", "model", "device", "dtype", "hardware"],
                    "properties": {k: string for k in ("version", "model", "device", "dtype")}
                    | {"hardware": string},
                }
            ),
        },
        "/v1/models": {
            "description": "the names a request may give in `model`",
            "content": _json(
                {
                    "type": "object",
                    "required": ["object", "data"],
                    "properties": {
                        "object": {"const": "list"},
                        "data": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "required": ["id", "object", "created", "owned_by"],
                                "properties": {
                                    "id": string,
                                    "object": {"const": "model"},
                                    "created": {"type": "integer"},
                                    "owned_by": string,
                                    "max_model_len": {"type": "integer", "minimum": 1},
                                },
                            },
                        },
                    },
                }
            ),
        },
        "/tokenize": {
            "description": "the prompt's token ids",
            "content": _json(
                {
                    "type": "object",
                    "required": ["count", "max_model_len", "tokens"],
                    "properties": {
                        "count": {"type": "integer", "minimum": 0},
                        "max_model_len": {"type": "integer", "minimum": 1},
                        "tokens": ints,
                    },
                }
            ),
        },
        "/detokenize": {
            "description": "the text of the token ids",
            "content": _json(
                {"type": "object", "required": ["prompt"], "properties": {"prompt": string}}
            ),
        },
        "/v1/completions": {
            "description": "the completion (JSON), or its stream",
            "content": _json(_COMPLETION) | {"text/event-stream": _SSE},
        },
        "/v1/chat/completions": {
            "description": "the chat completion (JSON), or its stream",
            "content": _json(_CHAT) | {"text/event-stream": _SSE},
        },
    }
    return answers.get(path, {"description": "OK"})


def _errors(path: str, method: str, guarded: bool) -> list[str]:
    """The error statuses a route can answer with."""
    codes = ["401"] if guarded else []
    if path == "/health":
        codes.append("503")
    if method == "post":
        codes += ["400", "404", "413"]
        if path in ("/v1/completions", "/v1/chat/completions"):
            codes += ["429", "503"]
    return sorted(codes)


def _branches(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """A property's schema and the members of its ``anyOf``."""
    return [schema, *schema.get("anyOf", [])]


def _with_type(schema: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [b for b in _branches(schema) if b.get("type") == kind]


def _bound_token_ids(schema: dict[str, Any], vocab_size: int) -> None:
    """Every integer in ``schema`` (items of items included) is a token id."""
    if schema.get("type") == "integer":
        schema["minimum"] = 0
        schema["maximum"] = vocab_size - 1
    for branch in schema.get("anyOf", []):
        _bound_token_ids(branch, vocab_size)
    if isinstance(schema.get("items"), dict):
        _bound_token_ids(schema["items"], vocab_size)


def _bound_strings(schema: dict[str, Any], limits: ServerConfig) -> None:
    """``stop`` and ``bad_words``: non-empty strings, within the limits on count and length."""
    text = {"minLength": 1, "maxLength": limits.max_stop_string_chars}
    for branch in _with_type(schema, "string"):
        branch.update(text)
    for branch in _with_type(schema, "array"):
        branch["maxItems"] = limits.max_stop_strings
        branch["items"].update(text)


def _request_schemas(
    schemas: dict[str, Any],
    names: list[str],
    vocab_size: int,
    limits: ServerConfig,
    image_parts: bool = False,
) -> None:
    for name, schema in schemas.items():
        props = schema.get("properties", {})
        if "model" in props:
            for branch in _with_type(props["model"], "string"):
                branch["enum"] = list(names)
        for field in ("prompt", "tokens", "stop_token_ids", "allowed_token_ids"):
            if field in props:
                _bound_token_ids(props[field], vocab_size)
        for field in ("stop", "bad_words"):
            if field in props:
                _bound_strings(props[field], limits)
        if "logit_bias" in props:
            for branch in _with_type(props["logit_bias"], "object"):
                branch["propertyNames"] = {"pattern": "^[0-9]+$"}
                branch["maxProperties"] = limits.max_logit_bias
        if name == "CompletionRequest":  # no prompt may be empty
            for branch in _with_type(props["prompt"], "string"):
                branch["minLength"] = 1
            for branch in _with_type(props["prompt"], "array"):
                branch["minItems"] = 1
                items = branch["items"]
                if items.get("type") != "integer":  # a batch of prompts
                    branch["maxItems"] = limits.max_prompts_per_request
                    items["minLength" if items.get("type") == "string" else "minItems"] = 1
        if name == "TokenizeRequest":  # exactly one of prompt and messages
            schema["oneOf"] = [
                {"required": [given], "properties": {given: {"not": {"type": "null"}}}}
                for given in ("prompt", "messages")
            ]
        if "messages" in props:
            for branch in _with_type(props["messages"], "array"):
                branch["maxItems"] = limits.max_messages
        if name == "ChatMessage":
            for branch in _with_type(props["content"], "array"):
                branch["items"] = copy.deepcopy(_TEXT_PART)
                if image_parts:  # the model reads images: image_url parts too
                    branch["items"] = {"anyOf": [branch["items"], copy.deepcopy(_IMAGE_PART)]}
        supported = ("tools", "tool_choice", "parallel_tool_calls") if "messages" in props else ()
        for field, why in _UNSUPPORTED.items():
            if field in props and field not in supported:
                allowed: list[Any] = [None, "none"] if field == "tool_choice" else [None]
                props[field] = {"enum": allowed, "description": f"not supported: {why}"}


def openapi_document(
    app: FastAPI,
    names: list[str],
    vocab_size: int,
    limits: ServerConfig,
    guarded: bool,
    image_parts: bool = False,
) -> dict[str, Any]:
    """The document of ``app``'s routes; ``guarded``: an API key is required; ``image_parts``:
    the model reads images (chat messages take ``image_url`` parts)."""
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description="Pagoda's OpenAI-compatible API. Every error is OpenAI's error body.",
        routes=app.routes,
    )
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas["ErrorResponse"] = copy.deepcopy(_ERROR)
    _request_schemas(schemas, names, vocab_size, limits, image_parts)
    if guarded:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc.get("paths", {}).items():
        for method, operation in operations.items():
            needs_key = guarded and not (
                path == "/health" or (path == "/metrics" and limits.public_metrics)
            )
            if needs_key:
                operation["security"] = [{"bearer": []}]
            responses: dict[str, Any] = {"200": _ok(path)}
            for code in _errors(path, method, needs_key):
                responses[code] = {
                    "description": _WHY[code],
                    "content": _json({"$ref": "#/components/schemas/ErrorResponse"}),
                }
            operation["responses"] = responses
    return doc


def install(
    app: FastAPI,
    names: list[str],
    vocab_size: int,
    limits: ServerConfig,
    guarded: bool,
    image_parts: bool = False,
) -> None:
    """Serve ``openapi_document`` as ``app``'s ``/openapi.json`` (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(
                app, names, vocab_size, limits, guarded, image_parts
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
