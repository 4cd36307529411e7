"""The OpenAI-compatible HTTP server (``pagoda serve``): FastAPI routes over one ``AsyncLLM``."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagoda
from pagoda.bench.report import hardware
from pagoda.config import EngineConfig
from pagoda.engine.async_llm import AsyncLLM, RequestRefusedError
from pagoda.engine.core_client import EngineDeadError, EngineStartError
from pagoda.entrypoints.openai.chat_parsers import ServerParsers
from pagoda.entrypoints.openai.errors import APIError, from_validation_error
from pagoda.entrypoints.openai.limits import BodyGuard, check_count
from pagoda.entrypoints.openai.lora_modules import LoRAModules
from pagoda.entrypoints.openai.openapi import install as install_openapi
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagoda.entrypoints.openai.serving import ShuttingDownError, off_loop
from pagoda.entrypoints.openai.serving_chat import ServingChat
from pagoda.entrypoints.openai.serving_completion import ServingCompletion
from pagoda.entrypoints.openai.serving_pooling import (
    ClassifyRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    ServingPooling,
)

logger = logging.getLogger("pagoda.server")


def model_names(engine: AsyncLLM) -> list[str]:
    """The names a request may give in ``model`` and ``/v1/models`` lists: the served name
    alone (``AsyncLLM.served_model_name``), never a second id for the model's path."""
    return [engine.served_model_name]


def build_app(engine: AsyncLLM, names: list[str], api_key: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield

    app = FastAPI(title="Pagoda", version=pagoda.__version__, lifespan=lifespan)
    completions = ServingCompletion(engine, names)
    chat = ServingChat(engine, names)
    pooling = ServingPooling(engine, names)
    # LoRA adapters as models (raises ValueError naming a bad --lora-modules adapter).
    loras = LoRAModules(engine, names) if engine.config.lora.enable_lora else None
    completions.loras = chat.loras = loras
    server = engine.config.server
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        where = f"{request.method} {request.url.path}"
        return APIError(f"{exc.detail}: {where}", exc.status_code).response()

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> Response:
        return APIError(f"the engine stopped: {exc}", 503).response()

    @app.exception_handler(RequestRefusedError)
    async def _refused(request: Request, exc: RequestRefusedError) -> Response:
        return APIError(str(exc)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("request failed")
        return APIError(f"internal error: {type(exc).__name__}: {exc}", 500).response()

    @app.middleware("http")
    async def _auth(request: Request, call_next: Callable[[Request], Awaitable[Response]]):
        path = request.url.path
        open_path = path == "/health" or (path == "/metrics" and server.public_metrics)
        if api_key is not None and not open_path:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return APIError(
                    "invalid or missing API key: send `Authorization: Bearer <key>`",
                    401,
                    code="invalid_api_key",
                ).response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        try:
            engine.check_health()
        except EngineDeadError as e:
            return APIError(str(e), 503).response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        info = engine.info
        return {
            "version": pagoda.__version__,
            "model": names[0],
            "device": info.device.type,
            "dtype": str(info.dtype).removeprefix("torch."),
            "hardware": hardware(info.device),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        adapters = {} if loras is None else loras.by_name
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagoda",
                "root": adapters[name].lora_path if name in adapters else engine.info.hf_dir,
                "parent": names[0] if name in adapters else None,
                "max_model_len": engine.info.max_model_len,
            }
            for name in names
        ]
        return {"object": "list", "data": data}

    if loras is not None and engine.config.server.allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            try:
                await off_loop(loras.add, body.lora_name, body.lora_path)
            except ValueError as e:
                raise APIError(str(e), param="lora_path") from e
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            loras.remove(body.lora_name)
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await _until_disconnect(request, completions.create(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await _until_disconnect(request, chat.create(body))

    # Pooling: embeddings, scores, reranking, classification (``serving_pooling``).
    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await _until_disconnect(request, _json(pooling.embeddings(body)))

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(body: ScoreRequest, request: Request) -> Response:
        return await _until_disconnect(request, _json(pooling.score(body)))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def create_rerank(body: RerankRequest, request: Request) -> Response:
        return await _until_disconnect(request, _json(pooling.rerank(body)))

    @app.post("/classify")
    @app.post("/v1/classify")
    async def create_classify(body: ClassifyRequest, request: Request) -> Response:
        return await _until_disconnect(request, _json(pooling.classify(body)))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        completions.check_model(body.model)
        if body.messages is not None:
            check_count("messages", len(body.messages), server.max_messages, "max_messages")
            rendered = await chat.render(
                body.messages,
                body.add_generation_prompt,
                template_kwargs=body.chat_template_kwargs,
                chat_template=body.chat_template,
            )
            ids = rendered["prompt_token_ids"]
        else:
            ids = await off_loop(
                engine.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
            )
        return {"count": len(ids), "max_model_len": engine.info.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        completions.check_model(body.model)
        vocab = engine.info.shape.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": await off_loop(engine.tokenizer.decode, body.tokens)}

    app.add_middleware(
        BodyGuard, max_bytes=server.max_request_body_bytes, max_depth=server.max_json_depth
    )
    install_openapi(
        app,
        names,
        engine.info.shape.vocab_size,
        server,
        guarded=api_key is not None,
        image_parts=engine.engine.input_processor.mm_processor is not None,
    )
    return app


async def _json(work: Awaitable[dict[str, Any]]) -> Response:
    return JSONResponse(await work)


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work`` unless the client goes away first; then cancel it, which aborts its
    requests and frees their blocks. (Once streaming, Starlette itself cancels on disconnect.)"""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nobody is listening
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def run_server(config: EngineConfig) -> int:
    """Start the engine and serve until interrupted."""
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    try:
        ServerParsers.of(config.server)  # an unknown parser fails before the model loads
        engine = AsyncLLM(config)
    except (EngineStartError, OSError, ValueError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 1
    try:
        names = model_names(engine)
        try:
            app = build_app(engine, names, config.server.api_key)
        except ValueError as e:  # a LoRA adapter of --lora-modules it cannot serve
            print(f"pagoda: error: {e}", file=sys.stderr)
            return 1
        host, port = config.server.host, config.server.port
        pids = ", ".join(str(p) for p in engine.client.pids)
        logger.info("serving %s on http://%s:%d (engine pid %s)", names[0], host, port, pids)
        grace = config.server.shutdown_grace_s
        uv_config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info",
            access_log=False,
            timeout_graceful_shutdown=grace + _FLUSH_S,
        )
        with _quiet_exit_signals():
            _GracefulServer(uv_config, engine, grace).run()
    finally:
        engine.shutdown()
        logger.info("stopped")
    return 0


# After the grace period: how long the ended requests get to send their error before uvicorn
# cancels what is left.
_FLUSH_S = 2.0


class _GracefulServer(uvicorn.Server):
    """On SIGTERM or Ctrl-C: uvicorn stops accepting connections and lets the requests in flight
    finish; after ``grace`` seconds those still running end with a 503 (in-band on a stream)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, grace: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deadline: asyncio.TimerHandle | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit and self._loop is not None:
            logger.info(
                "stopping: no new requests; %d in flight get %g s to finish",
                self.engine.num_running_requests,
                self.grace,
            )
            self._loop.call_soon_threadsafe(self._start_grace)
        super().handle_exit(sig, frame)

    def _start_grace(self) -> None:
        assert self._loop is not None
        self._deadline = self._loop.call_later(self.grace, self._end_in_flight)

    def _end_in_flight(self) -> None:
        n = self.engine.num_running_requests
        if n:
            logger.warning("grace period over: ending %d requests still in flight", n)
        self.engine.fail_all(
            ShuttingDownError("the server is shutting down; the request was ended, retry it")
        )


@contextlib.contextmanager
def _quiet_exit_signals() -> Iterator[None]:
    """While uvicorn serves: SIGTERM and SIGINT are its own; once it has stopped, the signal it
    re-raises ends nothing more, so that the engine is shut down and the exit status is 0."""
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in _EXIT_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)
