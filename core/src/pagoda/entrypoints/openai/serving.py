"""What the completion and chat endpoints share: model names, limits, submitting requests,
merging the streams of a batch, and server-sent events."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagoda.engine.async_llm import AsyncLLM, RequestRefusedError
from pagoda.engine.core_client import EngineDeadError
from pagoda.engine.request_stream import OutputKind
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.lora_modules import LoRAModules
from pagoda.lora_request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.plugins import RequestRejectedError
from pagoda.sampling_params import SamplingParams

T = TypeVar("T")

# Tokenizing and chat templates run here, off the event loop: a 5 MB prompt takes seconds, and
# the tokenizer releases the GIL while it works, so the loop keeps serving everyone else.
_POOL = ThreadPoolExecutor(4, thread_name_prefix="pagoda-tokenize")


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in the tokenizing threads."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, functools.partial(fn, *args, **kwargs))


class Serving:
    def __init__(self, engine: AsyncLLM, model_names: list[str]) -> None:
        self.engine = engine
        self.model_names = model_names
        self.max_model_len = engine.info.max_model_len
        self.limits = engine.config.server
        # The LoRA adapters this endpoint serves (None: the base model alone; an adapter's name
        # is then refused).
        self.loras: LoRAModules | None = None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def adapter_of(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter that model ``name`` selects (None: the base model), found by the
        resolvers if the server does not serve it yet."""
        return None if self.loras is None else await self.loras.find(name)

    def check_model(self, name: str | None) -> str:
        """The model name to answer with; 404 for a model this server does not serve."""
        if name is None or name == self.model_names[0]:
            return self.model_names[0]
        if name in self.model_names:
            if self.loras is not None and name in self.loras.by_name:
                return name
            raise APIError(
                f"The model `{name}` is a LoRA adapter, which serves completions and chat only",
                param="model",
            )
        raise APIError(
            f"The model `{name}` does not exist. This server serves: {', '.join(self.model_names)}",
            404,
            param="model",
            code="model_not_found",
        )

    def max_tokens(self, requested: int | None, num_prompt_tokens: int, what: str) -> int:
        """``requested``, or all the room left; 400 when the prompt and output do not fit."""
        limit = self.max_model_len
        room = limit - num_prompt_tokens
        if requested is None and room >= 1:
            return room
        total = num_prompt_tokens + (requested or 1)
        if total > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{total} tokens ({num_prompt_tokens} in the {what}, {requested or 1} in the "
                "completion). Please reduce the length of the "
                f"{what} or completion.",
                param="max_tokens" if requested and num_prompt_tokens < limit else what,
                code="context_length_exceeded",
            )
        return requested or 1

    async def submit(
        self,
        requests: list[tuple[str, dict[str, Any], SamplingParams]],
        kind: OutputKind,
        priority: int,
        constraint_field: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Add requests (request id, prompt, parameters) to the engine and wait until it has
        admitted all of them, so that the answer's status is known before any body is sent.

        Bad input is a 400 and reaches no engine loop; a request the engine sheds is a 429 with
        ``Retry-After``. Either way none of ``requests`` is left running. A refused
        constraint is named by ``constraint_field``, the request field that gave it.
        """
        streams = []
        try:
            for request_id, prompt, params in requests:
                try:
                    stream = self.engine.add_request(
                        request_id,
                        prompt,
                        params,
                        output_kind=kind,
                        priority=priority,
                        lora_request=lora_request,
                    )
                except EngineDeadError as e:
                    raise APIError(f"the engine is not running: {e}", 503) from e
                except (ValueError, TypeError) as e:
                    raise bad_value(e, constraint_field) from e
                streams.append((request_id, stream))
            for _, stream in streams:
                await stream.admitted()
        except BaseException as e:
            for request_id, _ in streams:
                self.engine.abort(request_id)
            if isinstance(e, Exception):
                raise self.error_of(e) from e
            raise
        return [self.engine.stream(rid, stream) for rid, stream in streams]

    def error_of(self, e: BaseException) -> APIError:
        """``error_of``, with this server's ``Retry-After`` on a 429."""
        error = error_of(e)
        if error.status == 429 and error.headers is None:
            error.headers = {"Retry-After": str(self.engine.config.server.retry_after_s)}
        return error


def new_id(prefix: str, given: str | None) -> str:
    """A request id unique in this server. A client's ``request_id`` is kept in it, for tracing,
    but never trusted to be unique: two clients may send the same one at once."""
    if given is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    return f"{prefix}-{given}-{uuid.uuid4().hex[:12]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def bad_value(e: ValueError | TypeError, constraint_field: str | None = None) -> APIError:
    """A 400 for a value the engine refused, naming the field of a ``SamplingParams`` error
    (without the class's name); a refused output constraint names ``constraint_field``, the
    request field that gave it."""
    msg = str(e)
    param = None
    if msg.startswith("SamplingParams."):
        msg = msg.removeprefix("SamplingParams.")  # the field the client sent, not the class
        param = re.split(r"[=:\s]", msg, maxsplit=1)[0]
        if param == "structured_outputs" and constraint_field is not None:
            reason = msg.partition(": ")[2]
            return APIError(f"`{constraint_field}`: {reason}", param=constraint_field)
    return APIError(msg, param=param)


class ShuttingDownError(Exception):
    """The server stopped taking requests and the grace period for those in flight ran out."""


def rejected(e: RequestRejectedError) -> APIError:
    """A 429 for a request an admission rule turned away (load shedding, a quota): the client
    may retry later, as after OpenAI's "overloaded" answers."""
    return APIError(str(e), 429, code="request_rejected")


def error_of(e: BaseException) -> APIError:
    """An exception raised while a request runs, as the API error to send."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(f"the engine stopped: {e}", 503)
    if isinstance(e, RequestRejectedError):
        return rejected(e)
    if isinstance(e, ShuttingDownError):
        return APIError(str(e), 503, code="server_shutting_down")
    if isinstance(e, (RequestRefusedError, ValueError)):
        return APIError(str(e))
    return APIError(f"internal error: {type(e).__name__}: {e}", 500)


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index.
    Closing the merged iterator closes every input (aborting their requests)."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except Exception as e:
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for it in streams:
            await it.aclose()  # type: ignore[attr-defined]
