"""Data parallelism (``parallel.data_parallel_size``): several engine cores, each in its own
process with its own executor (tensor parallel inside it), behind one client.

``DPClient`` starts the cores at once, routes each request to one (``DPCoordinator``: least
load, prefix affinity), sends an abort where its request went, and hands every core's outputs
on, tagged with the core. A core that dies fails only the requests it held; the client goes on
with the others and is dead only when none is left. ``SyncDPClient`` is the same client for
``LLMEngine`` (``LLM``): ``step`` polls the cores' sockets instead of an event loop.

With the Ray executor each core is a Ray actor in a placement group of its own, its ranks next
to it (``ray_cores``), on the cluster ``parallel.ray_address`` names, else a local one started
here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import zmq

from pagoda import wire
from pagoda.config import EngineConfig
from pagoda.engine.coordinator import DPCoordinator
from pagoda.engine.core_client import AsyncMPClient, EngineDeadError
from pagoda.engine.ray_cores import RayCluster, RayCoreProcess
from pagoda.executor.base import executor_name
from pagoda.executor.workers import world_size
from pagoda.model_info import ModelInfo
from pagoda.plugins import RequestRejectedError
from pagoda.request import Request
from pagoda.step import EngineCoreOutput

logger = logging.getLogger(__name__)

_POLL_MS = 100

# on_dead(error, lost): ``lost`` the sequences of the one core that stopped; None: every core
# has stopped, and with it every request.
OnDead = Callable[[EngineDeadError, list[str] | None, int | None], None]


def _visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def check_device_ranks(config: EngineConfig, info: ModelInfo) -> None:
    """On GPUs (without Ray, whose cluster places ranks), every rank needs a device of its own:
    ``ValueError`` naming the keys when data × tensor × pipeline parallel ranks outnumber them."""
    p = config.parallel
    if info.device.type != "cuda" or executor_name(p) == "ray":
        return
    ranks = p.data_parallel_size * p.tensor_parallel_size * p.pipeline_parallel_size
    gpus = len(_visible_gpus())
    if ranks > gpus:
        raise ValueError(
            f"parallel.data_parallel_size={p.data_parallel_size} x parallel.tensor_parallel_size="
            f"{p.tensor_parallel_size} x parallel.pipeline_parallel_size="
            f"{p.pipeline_parallel_size} = {ranks} ranks, more than the {gpus} GPUs visible; "
            "lower one of them, or use the ray executor on a cluster"
        )


def core_envs(config: EngineConfig, info: ModelInfo) -> list[dict[str, str]]:
    """Each core's environment: on GPUs without Ray, its own slice of the visible devices."""
    p = config.parallel
    if info.device.type != "cuda" or executor_name(p) == "ray":
        return [{} for _ in range(p.data_parallel_size)]
    per = p.tensor_parallel_size * p.pipeline_parallel_size
    gpus = _visible_gpus()
    return [
        {"CUDA_VISIBLE_DEVICES": ",".join(gpus[r * per : (r + 1) * per])}
        for r in range(p.data_parallel_size)
    ]


class DPClient:
    """``parallel.data_parallel_size`` engine cores behind one client, with ``AsyncMPClient``'s
    methods; ``on_outputs(msg, core)`` gets every core's outputs, ``on_dead(error, lost, core)``
    each core's death. Blocks until every core has loaded the model. ``check_device_ranks``
    is the caller's, before anything starts."""

    def __init__(
        self,
        config: EngineConfig,
        info: ModelInfo,
        on_outputs: Callable[[wire.EngineOutputs, int], None],
        on_dead: OnDead,
    ) -> None:
        n = config.parallel.data_parallel_size
        self.on_outputs = on_outputs
        self.on_dead = on_dead
        self.dead: EngineDeadError | None = None
        prefix = config.cache.enable_prefix_caching and not info.bidirectional
        self.coordinator = DPCoordinator(n, config.cache.block_size if prefix else None)
        self._core_of: dict[str, int] = {}  # sequence id -> the core that holds it
        self.cores: list[AsyncMPClient] = []
        self._ray: RayCluster | None = None
        try:
            host, make_process = None, None
            if executor_name(config.parallel) == "ray":
                gpu = info.device.type == "cuda"
                self._ray = RayCluster(config, len(_visible_gpus()) if gpu else 0)
                host = self._ray.host
                ranks = world_size(config.parallel)
                make_process = functools.partial(RayCoreProcess, ranks=ranks, gpu=gpu)
            for rank, env in enumerate(core_envs(config, info)):
                self.cores.append(
                    AsyncMPClient(
                        config,
                        functools.partial(self._core_outputs, rank),
                        functools.partial(self._core_dead, rank),
                        dp_rank=rank,
                        env=env,
                        wait=False,  # the cores load at the same time
                        host=host,
                        make_process=make_process,
                    )
                )
            for core in self.cores:
                core.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = sum(c.num_blocks for c in self.cores)  # over all cores
        self.max_model_len = self.cores[0].max_model_len
        self.coordinator.max_prefixes = self.num_blocks

    @property
    def pids(self) -> list[int | None]:
        return [c.pid for c in self.cores]

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if self.dead is not None:
            raise self.dead
        leader = request.prefill_leader
        if leader is not None and leader in self._core_of:  # samples of one prompt stay together
            core = self._core_of[leader]
        else:
            core = self.coordinator.route(request.prompt_token_ids)
        self._core_of[request.request_id] = core
        self.coordinator.started(core)
        try:
            self.cores[core].add_request(request)
        except BaseException:
            self._forget(request.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            core = self._forget(rid)
            if core is not None:
                by_core.setdefault(core, []).append(rid)
        for core, ids in by_core.items():
            self.cores[core].abort_requests(ids)

    def _forget(self, seq_id: str) -> int | None:
        core = self._core_of.pop(seq_id, None)
        if core is not None:
            self.coordinator.finished(core)
        return core

    def has_unfinished_requests(self) -> bool:
        return bool(self._core_of)

    def core_of(self, seq_id: str) -> int | None:
        """The core that holds a sequence (a request id, or ``i_id`` for sample i of n), None
        once it has finished."""
        return self._core_of.get(seq_id)

    # ---- what the cores send -------------------------------------------------------------------

    def _core_outputs(self, core: int, msg: wire.EngineOutputs) -> None:
        for out in msg.outputs:
            if out.finish_reason is not None:
                self._forget(out.request_id)
        for err in msg.errors:
            self._forget(err.request_id)
        if msg.stats is not None:
            self.coordinator.kv_usage(core, msg.stats.kv_cache_usage)
        self.on_outputs(msg, core)

    def _core_dead(self, core: int, error: EngineDeadError) -> None:
        self.coordinator.died(core)
        lost = [s for s, c in self._core_of.items() if c == core]
        for seq_id in lost:
            del self._core_of[seq_id]
        alive = sum(c.dead is None for c in self.cores)
        logger.error(
            "engine core %d of %d stopped (%d of its requests failed); %d left", core,
            len(self.cores), len(lost), alive,
        )  # fmt: skip
        if alive:
            self.on_dead(EngineDeadError(f"engine core {core} stopped: {error}"), lost, core)
        else:
            self.dead = EngineDeadError(f"every engine core has stopped; the last: {error}")
            self.on_dead(self.dead, None, core)

    # ---- health and utilities ------------------------------------------------------------------

    def check_alive(self) -> None:
        """Raise :class:`EngineDeadError` if no core can take a request."""
        if self.dead is not None:
            raise self.dead

    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` naming every core that has stopped (the others may
        still serve)."""
        self.check_alive()
        down = []
        for i, core in enumerate(self.cores):
            try:
                core.check_health()
            except EngineDeadError as e:
                down.append(f"engine core {i}: {str(e).splitlines()[0]}")
        if down:
            raise EngineDeadError(
                f"{len(down)} of {len(self.cores)} engine cores stopped ({'; '.join(down)}); "
                "the others keep serving"
            )

    def start(self) -> None:
        for core in self.cores:
            if core.dead is None:
                core.start()

    async def call_all(self, method: str, *args: Any) -> list[Any]:
        """``call_utility`` on every live core; their results in core order."""
        alive = [c for c in self.cores if c.dead is None]
        return list(await asyncio.gather(*(c.call_utility(method, *args) for c in alive)))

    def shutdown(self) -> None:
        for core in self.cores:
            core.shutdown()
        if self._ray is not None:
            self._ray.stop()


class SyncDPClient(DPClient):
    """``DPClient`` for ``LLMEngine``: ``step`` waits for the cores' next outputs. A refused
    request, or a core's death, raises from ``step`` (the requests of that core are lost)."""

    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self._ready: list[EngineCoreOutput] = []
        self._failure: BaseException | None = None
        super().__init__(config, info, self._collect, self._lost)
        self._poller = zmq.Poller()
        for core in self.cores:
            self._poller.register(core.out_socket, zmq.POLLIN)

    def _collect(self, msg: wire.EngineOutputs, core: int) -> None:
        self._ready += msg.outputs
        for err in msg.errors:
            cls = RequestRejectedError if err.rejected else ValueError
            self._failure = self._failure or cls(err.message)

    def _lost(self, error: EngineDeadError, lost: list[str] | None, core: int | None) -> None:
        self._failure = self._failure or error

    def step(self) -> list[EngineCoreOutput]:
        while not self._ready and self._failure is None and self.has_unfinished_requests():
            self._poller.poll(_POLL_MS)
            for core in self.cores:
                core.read_now()
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        outputs, self._ready = self._ready, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._core_of) or bool(self._ready)
