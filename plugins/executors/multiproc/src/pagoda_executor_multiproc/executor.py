"""Tensor and pipeline parallelism on one machine: one spawned worker process per rank (NCCL
between GPUs, gloo between CPU processes), driven by the engine over ZMQ with msgpack.

Each worker dies with the engine's process (Linux's parent-death signal) and ignores Ctrl-C, which
reaches the engine; ``shutdown``, an error, or the interpreter's exit stops and reaps them all.
"""

from __future__ import annotations

import multiprocessing
import weakref
from multiprocessing.process import BaseProcess

from pagoda.executor.worker_proc import WorkerSpec, free_port, run_worker_process
from pagoda.executor.workers import WorkerGroupExecutor, world_size


class MultiprocExecutor(WorkerGroupExecutor):
    transport = "ipc"

    def initialize(self) -> int:
        parallel = self.config.parallel
        ranks = world_size(parallel)
        if self.info.device.type == "cuda":
            import torch

            have = torch.cuda.device_count()
            if have < ranks:
                raise ValueError(
                    f"parallel.tensor_parallel_size={parallel.tensor_parallel_size} x "
                    f"parallel.pipeline_parallel_size={parallel.pipeline_parallel_size} needs "
                    f"{ranks} GPUs on this machine; {have} are visible (CUDA_VISIBLE_DEVICES). "
                    "Use the ray executor to span machines"
                )
        self.procs: list[BaseProcess] = []
        return super().initialize()

    def dist_init_method(self) -> str:
        return f"tcp://127.0.0.1:{free_port()}"

    def start_workers(self, specs: list[WorkerSpec]) -> None:
        ctx = multiprocessing.get_context("spawn")
        for spec in specs:
            proc = ctx.Process(
                target=run_worker_process, args=(spec,), name=f"PagodaTPWorker-{spec.rank}"
            )
            proc.start()
            self.procs.append(proc)
        # Also at the interpreter's exit, before multiprocessing waits for its children.
        self._finalizer = weakref.finalize(self, _reap, list(self.procs), 0.0)

    def dead_worker(self) -> str | None:
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                return f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def stop_workers(self, timeout_s: float) -> None:
        _reap(self.procs, timeout_s)


def _reap(procs: list[BaseProcess], timeout_s: float) -> None:
    """Wait for the processes up to ``timeout_s``, then terminate, then kill; join every one."""
    for proc in procs:
        proc.join(timeout_s)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
