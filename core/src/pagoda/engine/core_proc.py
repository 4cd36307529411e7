"""The engine process: an ``EngineCore`` in a busy loop behind two ZMQ sockets.

The loop blocks on the input socket while idle, steps while there is work, and pushes each step's
outputs (with the scheduler's stats) back to the client. A bad request is refused alone, with an
error for its client; an error inside a step ends the process, and the client, watching the
process, fails every request it holds.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from pagoda import wire
from pagoda.config import EngineConfig
from pagoda.engine.heap import HeapTrimmer
from pagoda.plugins import PLUGIN_API_VERSION, RequestRejectedError, hookimpl, register_plugin
from pagoda.process import die_with_parent, run_then_end_quietly

logger = logging.getLogger(__name__)

# How often an idle engine checks that its parent still lives.
_IDLE_POLL_MS = 1000

# What a client may call with ``UtilityCall`` (name -> function of the core and the args).
UTILITIES: dict[str, Callable[..., Any]] = {
    "ping": lambda core: "pong",
    "reset_prefix_cache": lambda core: core.kv_cache_manager.reset_prefix_cache(),
    "num_free_blocks": lambda core: core.kv_cache_manager.num_free_blocks,
}


def run_engine_process(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    dp_rank: int | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Entry point of the spawned process; it ends without the interpreter's teardown.
    ``dp_rank``: which data-parallel core this is (for the log); ``env``: variables set before
    anything loads (a core's devices)."""
    os.environ.update(env or {})
    run_then_end_quietly(_run_engine, config, input_addr, output_addr, dp_rank)


def run_engine_in_actor(
    config: EngineConfig, input_addr: str, output_addr: str, dp_rank: int | None = None
) -> int:
    """Run an engine in a process someone else started and watches (a Ray actor's): no
    parent watch, no signal handlers; returns the exit status."""
    try:
        _run_engine(config, input_addr, output_addr, dp_rank, own_process=False)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def _run_engine(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    dp_rank: int | None = None,
    own_process: bool = True,
) -> None:
    if own_process:
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server, which stops us
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    name = "engine" if dp_rank is None else f"engine dp{dp_rank}"
    logging.basicConfig(
        level=logging.INFO, format=f"%(levelname)s %(asctime)s {name} %(name)s: %(message)s"
    )
    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 5000)
    out_sock.connect(output_addr)
    encoder = wire.Encoder()
    try:
        # NOTE: imported here, inside the try, so that a failed import (a broken install, a
        # plugin) reaches the client as EngineFailed; the client imports this module for this
        # function only, without torch or the engine.
        from pagoda.engine.core import EngineCore
        from pagoda.model_info import ModelInfo
        from pagoda.process import tune_gc

        info = ModelInfo.from_config(config)
        # NOTE: registered before the core is built, which binds its seams then.
        stats = _StatsTracker()
        register_plugin(stats, "pagoda-engine-stats")
        core = EngineCore(config, info)
        tune_gc()  # this process runs the engine for the rest of its life
    except Exception:
        out_sock.send(encoder.encode(wire.EngineFailed(traceback.format_exc())))
        ctx.destroy(linger=5000)
        sys.exit(1)
    out_sock.send(encoder.encode(wire.EngineReady(core.num_blocks, info.max_model_len)))
    try:
        EngineLoop(core, in_sock, out_sock, stats).run()
    except Exception:
        logger.exception("the engine core failed")
        out_sock.send(encoder.encode(wire.EngineFailed(traceback.format_exc())))
        sys.exit(1)
    finally:
        core.shutdown()
        ctx.destroy(linger=1000)


class EngineLoop:
    def __init__(
        self,
        core: Any,
        in_sock: zmq.Socket,
        out_sock: zmq.Socket,
        stats: _StatsTracker | None = None,
    ) -> None:
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.decoder = wire.client_decoder()
        self.encoder = wire.Encoder()
        self.parent_pid = os.getppid()
        self.poller = zmq.Poller()
        self.poller.register(in_sock, zmq.POLLIN)
        self.stats = stats if stats is not None else _StatsTracker()
        self.stats.core = core
        self.heap = HeapTrimmer()  # free heap memory back to the OS when idle after work
        self.running = True

    def run(self) -> None:
        while self.running:
            busy = self.core.has_unfinished_requests()
            if not busy and not self.poller.poll(_IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:
                    logger.warning("the client process is gone; the engine stops")
                    return
                self.heap.idle()
                continue
            reply = self._handle_inputs()
            if not self.running:
                return
            if reply.accepted or reply.errors:
                # NOTE: admission results go out before the step, so a client learns of them (a
                # 429, or that it may start a streaming response) without waiting for a step.
                self.out_sock.send(self.encoder.encode(reply))
                reply = wire.EngineOutputs()
            if self.core.has_unfinished_requests():
                reply.outputs = self.core.step()
                reply.stats = self.stats.make()
                self.heap.worked()
            elif self.stats.changed():
                reply.stats = self.stats.make()  # e.g. an abort emptied the cache
            else:
                continue
            self.out_sock.send(self.encoder.encode(reply))

    def _handle_inputs(self) -> wire.EngineOutputs:
        """Take every message waiting on the socket, without blocking."""
        reply = wire.EngineOutputs()
        while True:
            try:
                frame = self.in_sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return reply
            msg = self.decoder.decode(frame.buffer)
            if isinstance(msg, wire.AddRequest):
                self._add(msg, reply)
            elif isinstance(msg, wire.AbortRequests):
                self.core.abort_requests(msg.request_ids)
            elif isinstance(msg, wire.UtilityCall):
                result = wire.EngineOutputs(utility=self._call_utility(msg))
                self.out_sock.send(self.encoder.encode(result))
            elif isinstance(msg, wire.Shutdown):
                self.running = False
                return reply

    def _add(self, msg: wire.AddRequest, reply: wire.EngineOutputs) -> None:
        try:
            request = msg.to_request()
            self.core.add_request(request)
        except Exception as e:  # refused alone; the client turns it into a 4xx
            message = str(e) or type(e).__name__
            rejected = isinstance(e, RequestRejectedError)
            reply.errors.append(wire.RequestError(msg.request_id, message, rejected))
            return
        reply.accepted.append(msg.request_id)
        self.stats.arrived(request)

    def _call_utility(self, msg: wire.UtilityCall) -> wire.UtilityResult:
        fn = UTILITIES.get(msg.method)
        if fn is None:
            return wire.UtilityResult(
                msg.call_id, error=f"unknown utility {msg.method!r}; known: {sorted(UTILITIES)}"
            )
        try:
            return wire.UtilityResult(msg.call_id, result=fn(self.core, *msg.args))
        except Exception as e:
            return wire.UtilityResult(msg.call_id, error=f"{type(e).__name__}: {e}")


class _StatsTracker:
    """Gathers ``SchedulerStats``: the state now, and the events since the previous call.

    It is also a plugin of the engine core's ``on_step_end`` seam, which gives it each step's
    token count (``pagoda:iteration_tokens_total``), and of the KV cache manager's
    ``on_blocks_evicted`` (``pagoda:prefix_cache_evicted_blocks``).
    """

    PAGODA_PLUGIN_API = PLUGIN_API_VERSION

    def __init__(self) -> None:
        self.core: Any = None  # set by the engine loop
        self.unscheduled: dict[str, Any] = {}  # request id -> request, until first scheduled
        self.preemptions_seen = 0
        self.encoder_seen = (0, 0)  # the encoder cache's (queries, hits) at the last stats
        self.last: tuple[int, int, float] | None = None
        self.iteration_tokens: list[int] = []
        self.evicted_blocks = 0

    @hookimpl
    def on_step_end(self, scheduler_output: Any) -> None:
        self.iteration_tokens.append(scheduler_output.total_num_scheduled_tokens)

    @hookimpl
    def on_blocks_evicted(self, block_ids: list[int]) -> None:
        self.evicted_blocks += len(block_ids)

    def arrived(self, request: Any) -> None:
        self.unscheduled[request.request_id] = request

    def _state(self) -> tuple[int, int, float]:
        s = self.core.scheduler
        return s.num_running, s.num_waiting, self.core.kv_cache_manager.usage

    def changed(self) -> bool:
        return self._state() != self.last

    def make(self) -> wire.SchedulerStats:
        now = time.monotonic()
        queue_times = []
        for rid, req in list(self.unscheduled.items()):
            if req.num_cached_tokens >= 0:  # set at the first scheduling
                queue_times.append(now - req.arrival_time)
                del self.unscheduled[rid]
            elif req.is_finished:  # aborted while waiting
                del self.unscheduled[rid]
        prefix = self.core.kv_cache_manager.make_prefix_cache_stats()
        total = self.core.scheduler.num_preemptions_total
        preemptions, self.preemptions_seen = total - self.preemptions_seen, total
        self.last = self._state()
        running, waiting, usage = self.last
        steps, self.iteration_tokens = self.iteration_tokens, []
        evicted, self.evicted_blocks = self.evicted_blocks, 0
        compile_times, grammar_queries, grammar_hits = self.core.structured_output.take_stats()
        return wire.SchedulerStats(
            running,
            waiting,
            usage,
            prefix.queries,
            prefix.hits,
            preemptions,
            queue_times,
            steps,
            evicted,
            grammar_compile_times=compile_times,
            grammar_cache_queries=grammar_queries,
            grammar_cache_hits=grammar_hits,
            **_spec_fields(self.core.scheduler.make_spec_stats()),
            **_offload_fields(self.core.scheduler.offload),
            **_lora_fields(self.core.scheduler),
            **self._encoder_fields(),
        )

    def _encoder_fields(self) -> dict[str, Any]:
        cache = self.core.scheduler.encoder_cache
        if cache is None:
            return {}
        (queries, hits), self.encoder_seen = self.encoder_seen, (cache.queries, cache.hits)
        return {"encoder_cache_queries": cache.queries - queries,
                "encoder_cache_hits": cache.hits - hits}  # fmt: skip


def _lora_fields(scheduler: Any) -> dict[str, Any]:
    if scheduler.max_loras is None:
        return {}
    running, waiting = scheduler.lora_adapters()
    return {
        "max_lora": scheduler.max_loras,
        "running_lora_adapters": running,
        "waiting_lora_adapters": waiting,
    }


def _spec_fields(spec: Any) -> dict[str, Any]:
    """``SchedulerStats`` fields of the drafts verified since the last stats (or none)."""
    if spec is None:
        return {}
    return {
        "spec_num_drafts": spec.num_drafts,
        "spec_num_draft_tokens": spec.num_draft_tokens,
        "spec_num_accepted_tokens": spec.num_accepted_tokens,
        "spec_accepted_per_pos": spec.accepted_per_pos,
    }


def _offload_fields(offload: Any) -> dict[str, Any]:
    """``SchedulerStats`` fields of KV offload since the last stats (none when it is off)."""
    if offload is None:
        return {}
    stats = offload.make_stats()
    return {
        "offload_stored_blocks": stats.stored_blocks,
        "offload_loaded_blocks": stats.loaded_blocks,
        "cpu_prefix_cache_hits": stats.cpu_hit_tokens,
        "cpu_cache_usage": offload.usage,
    }
