"""The client side of the engine process: start it, send it requests, read its outputs.

``LLMEngine`` drives an ``EngineCore`` in its own process directly (the in-process client is the
core itself: ``add_request``, ``abort_requests``, ``step``). ``AsyncMPClient`` puts the core in
a process of its own, as ``AsyncLLM`` wants, so scheduling and the model never wait on the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import weakref
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from pagoda import wire
from pagoda.config import EngineConfig
from pagoda.engine.core_proc import run_engine_process
from pagoda.request import Request

logger = logging.getLogger(__name__)

# How long a send may wait for the engine to take a message before it counts as unreachable.
_SEND_TIMEOUT_MS = 2000


class EngineDeadError(RuntimeError):
    """The engine process has stopped; requests in flight are lost and new ones are refused."""


class EngineStartError(RuntimeError):
    """The engine process could not start (the message holds its traceback)."""


class AsyncMPClient:
    """Runs an ``EngineCore`` in a spawned process and talks to it over ZMQ with msgpack.

    The constructor blocks until the engine has loaded the model. ``start`` (in the event loop)
    begins reading outputs, handed to ``on_outputs``, and watching the process: when it dies,
    ``on_dead`` gets an :class:`EngineDeadError` at once.
    """

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[wire.EngineOutputs], None],
        on_dead: Callable[[EngineDeadError], None],
        *,
        dp_rank: int | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
        host: str | None = None,
        make_process: Callable[[tuple[Any, ...]], Any] | None = None,
    ) -> None:
        self.on_outputs = on_outputs
        self.on_dead = on_dead
        self.dead: EngineDeadError | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="pagoda-engine-")
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        if host is None:
            in_addr, out_addr = f"ipc://{self._ipc_dir}/in", f"ipc://{self._ipc_dir}/out"
            self._in.bind(in_addr)
            self._out.bind(out_addr)
        else:  # the engine runs on another machine, maybe: it connects to ``host`` over TCP
            in_addr = f"tcp://{host}:{self._in.bind_to_random_port('tcp://0.0.0.0')}"
            out_addr = f"tcp://{host}:{self._out.bind_to_random_port('tcp://0.0.0.0')}"
        self._encoder = wire.Encoder()
        self._decoder = wire.engine_decoder()
        self._utility_ids = itertools.count()
        self._utility_calls: dict[int, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        args = (config, in_addr, out_addr, dp_rank, env or {})
        # ``make_process``: a process-like stand-in (a Ray actor's, say) with the methods of
        # ``multiprocessing.Process`` used here and a ``sentinel`` readable once it has ended.
        self.proc: BaseProcess = (
            make_process(args)
            if make_process is not None
            else multiprocessing.get_context("spawn").Process(
                target=run_engine_process,
                args=args,
                name="PagodaEngineCore" if dp_rank is None else f"PagodaEngineCore_DP{dp_rank}",
            )
        )
        # Also runs at interpreter exit, before multiprocessing waits for its children.
        self._finalizer = weakref.finalize(
            self, _stop, self.proc, self._ctx, self._in, self._ipc_dir
        )
        try:
            self.proc.start()
        except BaseException:
            self._finalizer()  # the sockets (a process that did not start is not alive)
            raise
        self.num_blocks = self.max_model_len = 0
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the engine has loaded the model (the constructor does, unless told not
        to, so that several engines load at once)."""
        try:
            ready = self._wait_ready()
        except BaseException:
            self._finalizer()
            raise
        self.num_blocks = ready.num_blocks
        self.max_model_len = ready.max_model_len

    def _wait_ready(self) -> wire.EngineReady:
        while True:
            if self._out.poll(200):
                msg = self._decoder.decode(self._out.recv())
                if isinstance(msg, wire.EngineReady):
                    return msg
                if isinstance(msg, wire.EngineFailed):
                    raise EngineStartError(f"the engine process failed to start:\n{msg.message}")
            elif not self.proc.is_alive():
                raise EngineStartError(
                    f"the engine process exited with code {self.proc.exitcode} while starting; "
                    "its log above says why"
                )

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def start(self) -> None:
        """Begin reading outputs and watching the process; call within the event loop."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise RuntimeError("this engine is already bound to another running event loop")
        self._loop = loop
        self._loop.add_reader(self.proc.sentinel, self._on_exit)
        self._reader = self._loop.create_task(self._read_outputs(), name="pagoda-engine-outputs")

    async def _read_outputs(self) -> None:
        sock = zmq.asyncio.Socket.shadow(self._out.underlying)
        try:
            while True:
                frame = await sock.recv(copy=False)
                if not self._handle(self._decoder.decode(frame.buffer)):
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("reading engine outputs failed")
            self._mark_dead(f"reading engine outputs failed: {e!r}")

    def _handle(self, msg: Any) -> bool:
        """Hand on one message from the engine; False once it said it failed."""
        if isinstance(msg, wire.EngineOutputs):
            if msg.utility is not None:
                self._finish_utility(msg.utility)
            self.on_outputs(msg)
        elif isinstance(msg, wire.EngineFailed):
            self._mark_dead(f"the engine process failed:\n{msg.message}")
            return False
        return True

    @property
    def out_socket(self) -> zmq.Socket:
        """The socket the engine's outputs arrive on, for a caller that polls several."""
        return self._out

    def read_now(self) -> None:
        """Without an event loop (``start`` not called): hand on every message waiting, and
        notice an engine that has exited."""
        while self.dead is None:
            try:
                data = self._out.recv(zmq.NOBLOCK)
            except zmq.Again:
                if not self.proc.is_alive():
                    self._on_exit()
                return
            self._handle(self._decoder.decode(data))

    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the engine process has stopped."""
        if self.dead is not None:
            raise self.dead
        if not self.proc.is_alive():
            raise EngineDeadError("the engine process has exited")

    check_alive = check_health  # one engine: it takes requests exactly while it is healthy

    @property
    def pids(self) -> list[int | None]:
        return [self.proc.pid]

    def _on_exit(self) -> None:
        self.proc.join(1)  # reap it: it has exited, so this returns at once with its exit code
        self._mark_dead(f"the engine process exited unexpectedly (exit code {self.proc.exitcode})")

    def _mark_dead(self, why: str) -> None:
        if self.dead is not None:
            return
        logger.error("%s", why)
        self.dead = EngineDeadError(why)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.proc.sentinel)
        for fut in self._utility_calls.values():
            if not fut.done():
                fut.set_exception(self.dead)
        self._utility_calls.clear()
        self.on_dead(self.dead)

    def _send(self, msg: Any) -> None:
        if self.dead is not None:
            raise self.dead
        data = self._encoder.encode(msg)
        try:
            self._in.send(data, zmq.NOBLOCK)
        except zmq.Again:
            # No engine connected on the other end right now: give it a moment, then give up.
            if not self._in.poll(_SEND_TIMEOUT_MS, zmq.POLLOUT):
                raise EngineDeadError("the engine process does not take requests") from None
            self._in.send(data, zmq.NOBLOCK)

    def add_request(self, request: Request) -> None:
        self._send(wire.AddRequest.from_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            self._send(wire.AbortRequests(request_ids))

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run ``core_proc.UTILITIES[method]`` in the engine process; return its result."""
        self.start()
        call_id = next(self._utility_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = fut
        self._send(wire.UtilityCall(call_id, method, list(args)))
        return await fut

    async def call_all(self, method: str, *args: Any) -> list[Any]:
        """``call_utility``'s result in a list (as a data-parallel client gives one per core)."""
        return [await self.call_utility(method, *args)]

    def _finish_utility(self, result: wire.UtilityResult) -> None:
        fut = self._utility_calls.pop(result.call_id, None)
        if fut is None or fut.done():
            return
        if result.error is not None:
            fut.set_exception(RuntimeError(result.error))
        else:
            fut.set_result(result.result)

    def shutdown(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            if self._reader is not None:
                self._reader.cancel()
            if self.dead is None:
                self._loop.remove_reader(self.proc.sentinel)
        self._finalizer()


def _stop(proc: BaseProcess, ctx: zmq.Context, in_sock: zmq.Socket, ipc_dir: str) -> None:
    """Stop the engine process (politely, then not), close the sockets, remove the ipc files."""
    if proc.is_alive():
        with contextlib.suppress(zmq.ZMQError):
            in_sock.send(wire.Encoder().encode(wire.Shutdown()), zmq.NOBLOCK)
        proc.join(5)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(2)
    ctx.destroy(linger=0)
    shutil.rmtree(ipc_dir, ignore_errors=True)
