"""Data-parallel engine cores on a Ray cluster: each core a Ray actor in a placement group of its
own, bundle 0 for the core and one bundle per rank after it (the ray executor, inside the core,
puts its ranks there), so Ray decides the node of every core and keeps each core's ranks
together. The front process talks to the cores over ZMQ (TCP), as to local ones.

NOTE: Ray is imported inside the functions here: it is the ray executor plugin's dependency,
not the core's.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.core_client import EngineStartError
from pagoda.engine.core_proc import run_engine_in_actor
from pagoda.executor.workers import world_size

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120.0


class RayCluster:
    """The cluster the cores run on: the one ``parallel.ray_address`` (or ``RAY_ADDRESS``)
    names, or a local one started here and stopped by ``stop``."""

    def __init__(self, config: EngineConfig, gpus: int) -> None:
        try:
            import ray
        except ImportError as e:
            raise ValueError(
                "parallel.executor='ray' with parallel.data_parallel_size="
                f"{config.parallel.data_parallel_size} needs Ray ({e}); install pagoda-executor-ray"
            ) from None
        p = config.parallel
        self.started = False
        if not ray.is_initialized():
            address = p.ray_address or os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, log_to_driver=True)
            else:
                # One CPU for each core and each rank at least (logical: Ray only counts them).
                need = p.data_parallel_size * (world_size(p) + 1)
                ray.init(
                    num_cpus=max(need, os.cpu_count() or 1),
                    num_gpus=gpus,
                    include_dashboard=False,
                    log_to_driver=True,
                )
                self.started = True
        self.host = ray.util.get_node_ip_address()  # where the cores reach this process

    def stop(self) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False


class _CoreActor:
    """The actor one engine core runs in."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, config: EngineConfig, input_addr: str, output_addr: str, dp_rank: int) -> int:
        return run_engine_in_actor(config, input_addr, output_addr, dp_rank)


class RayCoreProcess:
    """One engine core as a Ray actor, with what ``AsyncMPClient`` uses of a
    ``multiprocessing.Process``: ``start``, ``is_alive``, ``join``, ``exitcode``, ``pid``,
    ``terminate``, ``kill`` and ``sentinel`` (a pipe that turns readable once the actor ends)."""

    def __init__(self, args: tuple[Any, ...], ranks: int, gpu: bool) -> None:
        self._args = args[:4]  # config, input address, output address, data-parallel rank
        self._ranks = ranks
        self._gpu = gpu
        self.pid: int | None = None
        self.exitcode: int | None = None
        self._actor: Any = None
        self._pg: Any = None
        self._read, self._write = os.pipe()
        self.sentinel = self._read
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rank = {"GPU": 1, "CPU": 1} if self._gpu else {"CPU": 1}
        self._pg = placement_group([{"CPU": 1}] + [dict(rank) for _ in range(self._ranks)])
        ready, _ = ray.wait([self._pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            self._end(1)
            raise EngineStartError(
                f"the Ray cluster did not grant engine core {self._args[3]} a placement group of "
                f"1 CPU and {self._ranks} x {rank} within {_PLACEMENT_TIMEOUT_S:.0f} s (it has "
                f"{ray.cluster_resources()}); lower parallel.data_parallel_size or the ranks a "
                "core (tensor x pipeline parallel), or add nodes"
            )
        env = {}
        if self._gpu:  # NOTE: the core resolves the ranks' device and dtype; it runs no kernel
            env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        self._actor = (
            ray.remote(_CoreActor)
            .options(
                num_cpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=0
                ),
                runtime_env={"env_vars": env},
            )
            .remote()
        )
        self.pid = ray.get(self._actor.pid.remote())
        run = self._actor.run.remote(*self._args)
        self._watcher = threading.Thread(
            target=self._watch, args=(run,), name="pagoda-ray-core-watch", daemon=True
        )
        self._watcher.start()

    def _watch(self, run: Any) -> None:
        import ray

        try:
            code = ray.get(run)
        except Exception as e:  # the actor died (killed, its node lost) or raised
            logger.error("engine core %s (Ray actor) stopped: %s", self._args[3], e)
            code = 1
        self._end(code if isinstance(code, int) else 1)

    def _end(self, code: int) -> None:
        import ray

        if self._pg is not None:
            try:
                ray.util.remove_placement_group(self._pg)
            except Exception:  # the cluster may be gone already
                pass
            self._pg = None
        self.exitcode = code
        os.write(self._write, b"\0")

    def is_alive(self) -> bool:
        return self._watcher is not None and self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self._watcher is not None:
            self._watcher.join(timeout)

    def terminate(self) -> None:
        import ray

        if self._actor is not None:
            ray.kill(self._actor, no_restart=True)

    kill = terminate
