"""``AsyncLLM``: many concurrent requests, each an async stream of outputs, for servers.

Input processing (tokenizing, validation) and output processing (detokenizing, stop strings) run
here, in the API process; the engine core runs in its own process (``AsyncMPClient``), as in
vLLM v1, so the model steps while this process serves HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pagoda import wire
from pagoda.config import EngineConfig
from pagoda.engine.core_client import AsyncMPClient, EngineDeadError
from pagoda.engine.dp_client import DPClient, check_device_ranks
from pagoda.engine.input_processor import PromptType
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.metrics import EngineMetrics
from pagoda.engine.request_stream import OutputKind, RequestStream
from pagoda.lora_request import LoRARequest
from pagoda.model_info import ModelInfo
from pagoda.outputs import PoolingRequestOutput, RequestOutput
from pagoda.plugins import RequestRejectedError
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestRefusedError(ValueError):
    """The engine process refused a request (for example a plugin's admission rule)."""


class AsyncLLM:
    """An engine for concurrent requests.

    ``async for out in llm.generate(prompt, params, request_id)`` streams one request;
    leaving the loop early (or cancelling the task) aborts it and frees its KV blocks.
    The constructor blocks until the engine process has loaded the model.
    """

    def __init__(self, config: EngineConfig, *, log_stats_interval: float = 10.0) -> None:
        self.config = config
        self._streams: dict[str, RequestStream] = {}
        self._seq_to_request: dict[str, str] = {}
        self._seq_ids: dict[str, list[str]] = {}  # request id -> its core sequences
        self._stats_task: asyncio.Task[None] | None = None
        # A bad model or config fails here, before any process starts.
        info = ModelInfo.from_config(config)
        check_device_ranks(config, info)
        self.client: AsyncMPClient | DPClient
        if config.parallel.data_parallel_size > 1:
            self.client = DPClient(config, info, self._on_outputs, self._on_dead)
        else:
            self.client = AsyncMPClient(config, self._on_outputs, self._on_dead)
        try:
            self.engine = LLMEngine(config, engine_core=self.client)
        except BaseException:
            self.client.shutdown()
            raise
        self.info = self.engine.info
        self.tokenizer = self.engine.tokenizer
        self.metrics = EngineMetrics(
            self.served_model_name, log_stats_interval, config.parallel.data_parallel_size
        )

    @property
    def served_model_name(self) -> str:
        """The model's one name in the API and in the metrics' ``model_name`` label:
        ``server.served_model_name``, else the model's name (a folder's name, a GGUF file's
        stem, the default model's name)."""
        return self.config.server.served_model_name or self.info.name

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs: Any) -> AsyncLLM:
        """Build from vLLM-style arguments, as ``LLM(model=..., ...)``."""
        if model is not None:
            kwargs["model"] = model
        return cls(EngineConfig.load(overrides=kwargs))

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start reading engine outputs and watching the engine process (in the event loop);
        ``generate`` calls it, a server calls it at startup so ``/health`` sees a dead engine."""
        self.client.start()
        loop = asyncio.get_running_loop()
        if self._stats_task is None or self._stats_task.get_loop() is not loop:
            self._stats_task = loop.create_task(self._log_stats())

    @property
    def dead(self) -> EngineDeadError | None:
        return self.client.dead

    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the engine process has stopped (with data
        parallelism: any of its cores, naming them, while the others may still serve)."""
        self.client.check_health()

    def shutdown(self) -> None:
        if self._stats_task is not None and not self._stats_task.get_loop().is_closed():
            self._stats_task.cancel()
        self.client.shutdown()

    # ---- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and submit a request (``lora_request``: its adapter; None: the base
        model); its outputs arrive on the returned stream. Raises ``ValueError``/``TypeError``
        for a bad prompt, parameters or adapter, before anything is sent."""
        self.start()
        self.client.check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        processed = self.engine.input_processor.process(prompt)
        holdback = 0
        if params.stop and not params.include_stop_str_in_output and output_kind != "final_only":
            holdback = max(len(s) for s in params.stop) - 1
        stream = RequestStream(OutputKind(output_kind), holdback)
        arrival = time.monotonic()
        # NOTE: a request it refuses leaves nothing registered or sent behind.
        self.engine.add_processed(
            request_id,
            processed.prompt,
            processed.prompt_token_ids,
            params,
            priority,
            final_only=stream.kind is OutputKind.FINAL_ONLY,  # no output is built before the last
            lora_request=lora_request,
            mm_inputs=processed.mm_inputs,
        )
        self._streams[request_id] = stream
        seq_ids = self.engine.output_processor.seq_ids(request_id)
        stream.unadmitted = len(seq_ids)
        self._seq_ids[request_id] = seq_ids
        for seq_id in seq_ids:
            self._seq_to_request[seq_id] = request_id
        self.metrics.add_sequences(seq_ids, len(processed.prompt_token_ids), arrival)
        return stream

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        *,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request until it finishes.

        ``output_kind``: cumulative (all text so far), delta (what is new) or final_only.
        Closing the iterator early, or cancelling the task that reads it, aborts the request.
        Raises :class:`EngineDeadError` if the engine process dies meanwhile.
        """
        request_id = request_id or uuid.uuid4().hex
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            # Images go through the model's processor in a thread, off the event loop.
            prompt = await asyncio.to_thread(self.engine.input_processor.process, prompt)
        stream = self.add_request(
            request_id,
            prompt,
            sampling_params,
            output_kind=output_kind,
            priority=priority,
            lora_request=lora_request,
        )
        outputs = self.stream(request_id, stream)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()  # aborts at once if left early, not when collected

    def add_pooling_request(
        self,
        request_id: str,
        prompt: PromptType | tuple[str, str],
        params: PoolingParams,
        *,
        priority: int = 0,
    ) -> RequestStream:
        """Validate and submit a pooling request (a prompt, or a pair of texts for a
        cross-encoder); its one output arrives on the returned stream. Raises ``ValueError``/
        ``TypeError`` naming the field for bad input, before anything is sent."""
        self.start()
        self.client.check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        engine = self.engine
        resolved = engine.resolve_pooling(params)
        processed = engine.input_processor.process_pooling(prompt, resolved.truncate_prompt_tokens)
        stream = RequestStream(OutputKind.FINAL_ONLY)
        arrival = time.monotonic()
        engine.add_pooling(request_id, processed.prompt, processed.prompt_token_ids, resolved,
                           priority)  # fmt: skip
        self._streams[request_id] = stream
        stream.unadmitted = 1
        self._seq_ids[request_id] = [request_id]
        self._seq_to_request[request_id] = request_id
        self.metrics.add_sequences([request_id], len(processed.prompt_token_ids), arrival)
        return stream

    async def encode(
        self,
        prompt: PromptType | tuple[str, str],
        pooling_params: PoolingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's ``encode``: a pooling request's output (one, once its prompt is computed), as
        an async stream like ``generate``'s; leaving it early aborts the request."""
        request_id = request_id or uuid.uuid4().hex
        stream = self.add_pooling_request(request_id, prompt, pooling_params, priority=priority)
        outputs = self.stream(request_id, stream)
        try:
            async for out in outputs:
                yield out  # type: ignore[misc]
        finally:
            await outputs.aclose()

    async def stream(self, request_id: str, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The outputs of a request added with ``add_request``; aborts it if left early."""
        try:
            while True:
                out = await stream.get()
                yield out
                if out.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored."""
        if self._streams.pop(request_id, None) is None:
            return
        self.metrics.end_sequences(self._forget(request_id), "abort")
        if self.client.dead is None:
            self.engine.abort_request([request_id])

    def fail_all(self, error: BaseException) -> None:
        """End every request now: abort it in the engine, and its consumer raises ``error``."""
        for request_id, stream in list(self._streams.items()):
            self.abort(request_id)
            stream.fail(error)

    async def reset_prefix_cache(self) -> None:
        self.start()
        await self.client.call_all("reset_prefix_cache")

    async def num_free_blocks(self) -> int:
        """Free KV cache blocks in the engine process now (over every live core)."""
        self.start()
        return sum(await self.client.call_all("num_free_blocks"))

    @property
    def num_running_requests(self) -> int:
        return len(self._streams)

    # ---- the output loop -----------------------------------------------------------------------

    def _on_outputs(self, msg: wire.EngineOutputs, core: int = 0) -> None:
        self.metrics.record(msg.outputs, msg.stats, core)
        for err in msg.errors:
            self._refused(err)
        for seq_id in msg.accepted:
            stream = self._streams.get(self._seq_to_request.get(seq_id, ""))
            if stream is not None:
                stream.admit()
        if not msg.outputs:
            return
        for out in msg.outputs:
            if out.finish_reason == "error":  # failed alone in the core (its grammar, say)
                self._refused(wire.RequestError(out.request_id, str(out.stop_reason)))
        outputs, to_abort = self.engine.output_processor.process_outputs(msg.outputs)
        if to_abort:  # ended here by a stop string
            self.client.abort_requests(to_abort)
            self.metrics.end_sequences(to_abort, "stop")
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
                self._forget(out.request_id)

    def _refused(self, err: wire.RequestError) -> None:
        request_id = self._seq_to_request.get(err.request_id)
        if request_id is None:
            return
        stream = self._streams.get(request_id)
        self.abort(request_id)  # the other samples of the request, if any
        if stream is not None:
            error = RequestRejectedError if err.rejected else RequestRefusedError
            stream.fail(error(err.message))

    def _forget(self, request_id: str) -> list[str]:
        seq_ids = self._seq_ids.pop(request_id, [])
        for seq_id in seq_ids:
            self._seq_to_request.pop(seq_id, None)
        return seq_ids

    def _on_dead(
        self, error: EngineDeadError, lost: list[str] | None = None, core: int | None = None
    ) -> None:
        """An engine process stopped: ``lost``, the sequences of the one data-parallel core
        that did (the others serve on); None: every request."""
        if core is not None:
            self.metrics.engine_stopped(core)
        if lost is not None:
            for request_id in {self._seq_to_request.get(s) for s in lost} - {None}:
                stream = self._streams.get(request_id)  # type: ignore[arg-type]
                self.abort(request_id)  # type: ignore[arg-type]
                if stream is not None:
                    stream.fail(error)
            return
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(error)
        self._seq_to_request.clear()
        self._seq_ids.clear()

    async def _log_stats(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                await asyncio.sleep(self.metrics.log_interval)
                self.metrics.log()
