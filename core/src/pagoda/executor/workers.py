"""The engine side of a group of workers (tensor-parallel ranks, in one or more pipeline
stages), shared by the multiprocess and Ray executors: a ZMQ socket to each rank and one back
from all, start-up calls, each step's scheduler output sent to every rank, the output rank's
answer read back (the first rank of the last stage), and the watch over the workers.

A subclass starts and stops the workers (processes, actors) and says when one is gone; this
class notices a worker that dies (at once) or hangs (no heartbeat for ``step_timeout_s``), stops
every worker and raises :class:`WorkerFailedError` naming it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import time
from abc import abstractmethod
from typing import Any

import zmq

from pagoda.config.model import ParallelConfig
from pagoda.executor import messages as m
from pagoda.executor.base import Executor, PendingOutput
from pagoda.executor.worker_proc import WorkerSpec
from pagoda.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_POLL_MS = 100


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died, hung or raised; the engine cannot go on."""


class _PendingStep:
    __slots__ = ("executor", "seq")

    def __init__(self, executor: WorkerGroupExecutor, seq: int) -> None:
        self.executor = executor
        self.seq = seq

    def get(self) -> ModelRunnerOutput:
        return self.executor._wait_output(self.seq)


class WorkerGroupExecutor(Executor):
    """Runs ``tensor_parallel_size * pipeline_parallel_size`` workers, one per rank; each
    stage sizes its own KV cache (its layers'), and the engine's is the smallest of them."""

    #: ``ipc`` (one machine) or ``tcp`` (workers may be on other machines).
    transport = "ipc"
    #: A worker silent this long (no heartbeat, no output) counts as hung.
    startup_timeout_s = 120.0
    step_timeout_s = 10.0

    # ---- what a subclass provides --------------------------------------------------------------

    @abstractmethod
    def start_workers(self, specs: list[WorkerSpec]) -> None:
        """Start one worker per spec (rank order); each runs ``WorkerProc(spec).run()``."""

    @abstractmethod
    def dead_worker(self) -> str | None:
        """Why a worker is gone (``"rank 1 (pid 42) exited with code -9"``), or None."""

    @abstractmethod
    def stop_workers(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the workers to exit, then kill those left; reap all."""

    def bind_host(self) -> tuple[str, str]:
        """(address to bind, address workers connect to) for the ``tcp`` transport."""
        return "127.0.0.1", "127.0.0.1"

    @abstractmethod
    def dist_init_method(self) -> str:
        """``tcp://host:port`` where the ranks meet for torch.distributed (rank 0's host)."""

    def device_index(self, rank: int) -> int | None:
        """The CUDA device of ``rank`` on its machine; None on a CPU."""
        return rank if self.info.device.type == "cuda" else None

    # ---- the executor --------------------------------------------------------------------------

    def initialize(self) -> int:
        self.world_size = world_size(self.config.parallel)
        self.failed: WorkerFailedError | None = None
        self._seq = itertools.count(1)
        self._call_ids = itertools.count()
        self._outputs: dict[int, ModelRunnerOutput] = {}
        self._last_seen = [time.monotonic()] * self.world_size
        self._timeout_s = self.startup_timeout_s
        self._encoder = m.encoder()
        self._decoder = m.executor_decoder()
        self._open_sockets()
        try:
            init = self.dist_init_method()
            specs = [
                WorkerSpec(
                    self.config,
                    self.info,
                    rank,
                    self.world_size,
                    init,
                    self._connect_addrs[rank],
                    self._results_connect,
                    self.device_index(rank),
                )
                for rank in range(self.world_size)
            ]
            self.start_workers(specs)
            hellos: dict[int, m.Hello] = {}
            while len(hellos) < self.world_size:
                msg = self._next_message()
                if isinstance(msg, m.Hello):
                    hellos[msg.rank] = msg
            self.worker_pids = [hellos[r].pid for r in range(self.world_size)]
            self.call_all("load_model")
            num_blocks = min(self.call_all("determine_num_blocks"))
            self.call_all("initialize_kv_cache", num_blocks)
            for times in self.call_all("startup_times"):
                for k, v in times.items():
                    self.startup_times[k] = max(v, self.startup_times.get(k, 0.0))
        except BaseException:
            self.shutdown()
            raise
        self._timeout_s = self.step_timeout_s
        self._last_seen = [time.monotonic()] * self.world_size
        return num_blocks

    def _open_sockets(self) -> None:
        self._ctx = zmq.Context()
        self._ipc_dir: str | None = None
        self._results = self._ctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        self._inboxes = [self._ctx.socket(zmq.PUSH) for _ in range(self.world_size)]
        if self.transport == "ipc":
            self._ipc_dir = tempfile.mkdtemp(prefix="pagoda-tp-")
            self._results_connect = f"ipc://{self._ipc_dir}/results"
            self._results.bind(self._results_connect)
            self._connect_addrs = []
            for rank, sock in enumerate(self._inboxes):
                addr = f"ipc://{self._ipc_dir}/rank{rank}"
                sock.bind(addr)
                self._connect_addrs.append(addr)
        else:
            bind, connect = self.bind_host()
            port = self._results.bind_to_random_port(f"tcp://{bind}")
            self._results_connect = f"tcp://{connect}:{port}"
            self._connect_addrs = []
            for sock in self._inboxes:
                port = sock.bind_to_random_port(f"tcp://{bind}")
                self._connect_addrs.append(f"tcp://{connect}:{port}")
        for sock in self._inboxes:
            sock.setsockopt(zmq.LINGER, 0)

    def _broadcast(self, msg: Any) -> None:
        data = self._encoder.encode(msg)
        for rank, sock in enumerate(self._inboxes):
            deadline = None
            while True:
                try:
                    sock.send(data, zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    # NOTE: a worker's hello comes back on the results socket, whose handshake
                    # can finish before that of its inbox (a loaded machine, slow actors): the
                    # first call may find no peer yet. Wait for one, as long as a silent worker
                    # may take, watching that none died.
                    now = time.monotonic()
                    deadline = deadline if deadline is not None else now + self._timeout_s
                    self._check_workers()
                    if now >= deadline:
                        raise self._fail(
                            f"tensor-parallel worker rank {rank} does not take its messages "
                            f"(waited {self._timeout_s:.0f} s); the engine stops"
                        ) from None
                    sock.poll(_POLL_MS, zmq.POLLOUT)

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``WorkerProc.<method>(*args)`` on every rank; the results in rank order."""
        if self.failed is not None:
            raise self.failed
        call_id = next(self._call_ids)
        self._broadcast(m.Call(call_id, method, list(args)))
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            msg = self._next_message()
            if isinstance(msg, m.Reply) and msg.call_id == call_id:
                results[msg.rank] = msg.result
        return [results[r] for r in range(self.world_size)]

    def launch(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        if self.failed is not None:
            raise self.failed
        seq = next(self._seq)
        self._broadcast(m.Step(seq, scheduler_output))
        return _PendingStep(self, seq)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(scheduler_output).get()

    def _wait_output(self, seq: int) -> ModelRunnerOutput:
        while seq not in self._outputs:
            msg = self._next_message()
            if isinstance(msg, m.StepDone):
                self._outputs[msg.seq] = msg.output
        return self._outputs.pop(seq)

    # ---- watching the workers ------------------------------------------------------------------

    def _next_message(self) -> Any:
        """The next message of a worker that is not a heartbeat; raises if a worker failed."""
        if self.failed is not None:
            raise self.failed
        next_check = time.monotonic() + _POLL_MS / 1e3
        while True:
            if self._results.poll(_POLL_MS):
                msg = self._decoder.decode(self._results.recv(copy=False).buffer)
                rank = getattr(msg, "rank", 0)
                self._last_seen[rank] = time.monotonic()
                if isinstance(msg, m.Failed):
                    raise self._fail(self._why_failed(msg))
                if isinstance(msg, m.Reply) and msg.error is not None:
                    raise self._fail(f"tensor-parallel worker rank {rank}: {msg.error}")
                if not isinstance(msg, m.Heartbeat):
                    return msg
            # NOTE: checked on a clock, not only when the socket is quiet: the heartbeats of
            # the live ranks would keep it from ever being quiet.
            if time.monotonic() >= next_check:
                self._check_workers()
                next_check = time.monotonic() + _POLL_MS / 1e3

    def _why_failed(self, msg: m.Failed) -> str:
        """A rank's error, or, where it only lost a peer that died, the peer's death."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            dead = self.dead_worker()
            if dead is not None and not dead.startswith(f"rank {msg.rank} "):
                last = msg.message.strip().splitlines()[-1]
                return (
                    f"tensor-parallel worker {dead}; the engine stops (rank {msg.rank} then "
                    f"lost it: {last})"
                )
            time.sleep(0.05)
        return f"tensor-parallel worker rank {msg.rank} failed:\n{msg.message}"

    def _check_workers(self) -> None:
        dead = self.dead_worker()
        if dead is not None:
            raise self._fail(f"tensor-parallel worker {dead}; the engine stops")
        now = time.monotonic()
        for rank, seen in enumerate(self._last_seen):
            if now - seen > self._timeout_s:
                raise self._fail(
                    f"tensor-parallel worker rank {rank} sent nothing for {now - seen:.1f} s "
                    f"(limit {self._timeout_s:.0f} s): it hangs; the engine stops"
                )

    def _fail(self, why: str) -> WorkerFailedError:
        logger.error("%s", why)
        self.failed = WorkerFailedError(why)
        self._stop(graceful=False)
        return self.failed

    # ---- stopping ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self._stop(graceful=self.failed is None)

    def _stop(self, graceful: bool) -> None:
        if getattr(self, "_ctx", None) is None:
            return
        if graceful:
            with contextlib.suppress(zmq.ZMQError):
                data = self._encoder.encode(m.Stop())
                for sock in self._inboxes:
                    sock.send(data, zmq.NOBLOCK)
        try:
            self.stop_workers(timeout_s=5.0 if graceful else 0.0)
        finally:
            self._ctx.destroy(linger=0)
            self._ctx = None
            if self._ipc_dir is not None:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)


def world_size(parallel: ParallelConfig) -> int:
    """The ranks one engine's executor runs: tensor-parallel ranks in each pipeline stage."""
    return parallel.tensor_parallel_size * parallel.pipeline_parallel_size


def worker_env() -> dict[str, str]:
    """The environment a worker elsewhere needs from this process: Pagoda's own variables (plugin
    lists, configuration), and the offline switches of the model hubs."""
    keep = ("PAGODA_", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TRITON_", "NCCL_", "GLOO_")
    return {k: v for k, v in os.environ.items() if k.startswith(keep)}
