"""Limits the server puts on a request before it does any work for it (``server.*`` keys;
``docs/serving.md`` lists them with what a client sees)."""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.config.model import ServerConfig
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.serving import off_loop

# A surrogate reaches a decoded JSON string either as a \u escape or as the raw bytes of its
# UTF-8-style encoding (ED A0..BF xx), which json.loads lets through ("surrogatepass").
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_OFF_LOOP_BYTES = 64 << 10


class BodyGuard:
    """ASGI middleware for request bodies, before the routes parse them:

    - longer than ``max_bytes``: 413, at once for a declared ``Content-Length``, as soon as the
      limit is passed for a chunked body (never read whole);
    - arrays and objects nested deeper than ``max_depth``: 400;
    - a string with a lone surrogate (``"\\ud800"``), which no tokenizer or response can encode:
      400 naming where it is.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await self._refuse(scope, send, self._too_large(f"{length} bytes"))
            return
        held: list[Message] = []
        body = bytearray()
        while True:
            message = await receive()
            held.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(scope, send, self._too_large("more than that"))
                return
            if not message.get("more_body", False):
                break
        data = bytes(body)
        if len(data) > _OFF_LOOP_BYTES:
            error = await off_loop(self.check, data)
        else:
            error = self.check(data)
        if error is not None:
            await self._refuse(scope, send, error)
            return

        async def replay() -> Message:
            return held.pop(0) if held else await receive()

        await self.app(scope, replay, send)

    def check(self, body: bytes) -> APIError | None:
        """The error for a body too deeply nested or holding a lone surrogate, else None."""
        try:
            root = json.loads(body)
        except RecursionError:
            return self._too_deep()
        except ValueError:
            return None  # not JSON: the route's parser says what is wrong with it
        if type(root) in _CONTAINERS and _too_deep(root, self.max_depth):
            return self._too_deep()
        # NOTE: most bodies hold no surrogate, escaped or raw; only those are walked.
        where = _surrogate_path(root) if _SURROGATE_ESCAPE.search(body) else None
        if where is not None:
            return APIError(
                f"`{where or 'the body'}` holds a lone UTF-16 surrogate (such as \\ud800), which "
                "is not Unicode text; send valid Unicode",
                param=where or None,
                code="invalid_unicode",
            )
        return None

    def _too_deep(self) -> APIError:
        return APIError(
            f"the request body nests arrays and objects more than {self.max_depth} deep "
            "(server.max_json_depth)",
            code="json_too_deep",
        )

    def _too_large(self, size: str) -> APIError:
        return APIError(
            f"the request body is too large: the limit is {self.max_bytes} bytes "
            f"(server.max_request_body_bytes), this one has {size}",
            413,
            code="request_too_large",
        )

    async def _refuse(self, scope: Scope, send: Send, error: APIError) -> None:
        await error.response()(scope, _no_receive, send)


_CONTAINERS = frozenset({dict, list})


def _too_deep(root: Any, max_depth: int) -> bool:
    """Whether arrays and objects nest deeper than ``max_depth`` (the outermost is 1), level by
    level: a level of leaves (token ids, strings) is passed over at C speed."""
    level, depth = [root], 1
    while level:
        below = []
        for value in level:
            items = value.values() if type(value) is dict else value
            if _CONTAINERS.isdisjoint(map(type, items)):
                continue
            if depth == max_depth:
                return True
            below.extend(v for v in items if v and type(v) in _CONTAINERS)
        level, depth = below, depth + 1
    return False


def _surrogate_path(root: Any) -> str | None:
    """The dotted path of the first string (key or value) that is not Unicode, or None."""
    todo: list[tuple[str, Any]] = [("", root)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str) and not _is_unicode(value):
            return path
        if isinstance(value, dict):
            for k, v in value.items():
                if not _is_unicode(k):
                    return f"{path}.{ascii(k)}" if path else ascii(k)
                todo.append((f"{path}.{k}" if path else k, v))
        elif isinstance(value, list):
            todo.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value))
    return None


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _no_receive() -> Any:
    return {"type": "http.disconnect"}


def check_sampling_limits(req: Any, limits: ServerConfig) -> None:
    """400 naming the field for stop strings, bad words or logit_bias past the server's limits:
    each is checked against every generated token, so their size is work for the engine."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    for name, strings in (("stop", stops), ("bad_words", req.bad_words or [])):
        if len(strings) > limits.max_stop_strings:
            raise APIError(
                f"`{name}` has {len(strings)} strings; the limit is {limits.max_stop_strings} "
                "(server.max_stop_strings)",
                param=name,
            )
        longest = max((len(s) for s in strings), default=0)
        if longest > limits.max_stop_string_chars:
            raise APIError(
                f"`{name}` has a string of {longest} characters; the limit is "
                f"{limits.max_stop_string_chars} (server.max_stop_string_chars)",
                param=name,
            )
    if req.logit_bias is not None and len(req.logit_bias) > limits.max_logit_bias:
        raise APIError(
            f"`logit_bias` has {len(req.logit_bias)} entries; the limit is "
            f"{limits.max_logit_bias} (server.max_logit_bias)",
            param="logit_bias",
        )


def check_count(name: str, count: int, limit: int, key: str) -> None:
    """400 naming ``name`` when a request holds more than ``limit`` of it."""
    if count > limit:
        raise APIError(
            f"`{name}` has {count} entries; the limit is {limit} (server.{key})", param=name
        )
