"""Tensor and pipeline parallelism on Ray: one actor per rank, in a placement group of one bundle
per rank (a GPU each, or a CPU), on the cluster ``parallel.ray_address`` names (else
``RAY_ADDRESS``'s, else a local one started here and stopped with the engine).

Ray places and starts the workers; each step then travels over ZMQ (TCP) with msgpack, the same
channel as the multiprocess executor's, so a step costs no Ray task.

An engine core that data parallelism placed on the cluster (``pagoda.engine.ray_cores``) runs
in bundle 0 of its own placement group; the executor puts the ranks in that group's other
bundles, next to the core, instead of making a group of its own.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pagoda.executor.worker_proc import WorkerSpec
from pagoda.executor.workers import WorkerGroupExecutor, worker_env, world_size

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120.0


class RayWorker:
    """The actor of one rank: it tells where it runs, then serves its executor until stopped."""

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        from pagoda.executor.worker_proc import free_port

        return free_port()

    def run(self, spec: WorkerSpec) -> None:
        from pagoda.executor.worker_proc import WorkerProc

        logging.basicConfig(
            level=logging.INFO,
            format=f"%(levelname)s %(asctime)s tp-rank-{spec.rank} %(name)s: %(message)s",
        )
        WorkerProc(spec).run()


class RayExecutor(WorkerGroupExecutor):
    transport = "tcp"

    def initialize(self) -> int:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        tp = world_size(self.config.parallel)  # every rank of every pipeline stage
        self._started_ray = False
        self.actors: list[Any] = []
        self._runs: list[Any] = []
        self.pg = None
        if not ray.is_initialized():
            address = self.config.parallel.ray_address or os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, log_to_driver=True)
            else:
                gpus = _local_gpus() if self.info.device.type == "cuda" else 0
                ray.init(
                    num_cpus=max(tp, os.cpu_count() or 1),
                    num_gpus=gpus,
                    include_dashboard=False,
                    log_to_driver=True,
                )
            self._started_ray = True
        gpu = self.info.device.type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        first = 0  # the bundle of rank 0
        try:
            core_group = ray.util.get_current_placement_group()
            if core_group is not None and len(core_group.bundle_specs) == tp + 1:
                pg, first = core_group, 1  # NOTE: not ours: the data-parallel client removes it
            else:
                pg = self.pg = placement_group([dict(bundle) for _ in range(tp)], strategy="PACK")
            ready, _ = ray.wait([pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
            if not ready:
                raise RuntimeError(
                    f"the Ray cluster did not grant {tp} bundles of {bundle} within "
                    f"{_PLACEMENT_TIMEOUT_S:.0f} s (it has {ray.cluster_resources()}); "
                    "lower parallel.tensor_parallel_size or parallel.pipeline_parallel_size, or "
                    "add nodes"
                )
            actor_cls = ray.remote(RayWorker)
            env = {"env_vars": worker_env()}
            for rank in range(tp):
                strategy = PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=first + rank
                )
                self.actors.append(
                    actor_cls.options(
                        num_cpus=0 if gpu else 1,
                        num_gpus=1 if gpu else 0,
                        scheduling_strategy=strategy,
                        runtime_env=env,
                        name=None,
                    ).remote()
                )
            self._rank0_ip = ray.get(self.actors[0].node_ip.remote())
        except BaseException:
            self.stop_workers(0.0)
            raise
        return super().initialize()

    def bind_host(self) -> tuple[str, str]:
        import ray

        return "0.0.0.0", ray.util.get_node_ip_address()

    def dist_init_method(self) -> str:
        import ray

        port = ray.get(self.actors[0].free_port.remote())
        return f"tcp://{self._rank0_ip}:{port}"

    def device_index(self, rank: int) -> int | None:
        # NOTE: Ray shows each actor its own GPU only.
        return 0 if self.info.device.type == "cuda" else None

    def start_workers(self, specs: list[WorkerSpec]) -> None:
        self._runs = [a.run.remote(s) for a, s in zip(self.actors, specs)]

    def dead_worker(self) -> str | None:
        import ray

        if not self._runs:
            return None
        done, _ = ray.wait(self._runs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self._runs.index(done[0])
        try:
            ray.get(done[0])
        except Exception as e:  # the actor died, or its loop raised
            return f"rank {rank} (Ray actor) stopped: {type(e).__name__}: {e}"
        return f"rank {rank} (Ray actor) stopped"

    def stop_workers(self, timeout_s: float) -> None:
        import ray

        if self._runs and timeout_s > 0:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self._runs = [], []
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()
