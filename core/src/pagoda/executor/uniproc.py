"""The in-process executor: one worker in the engine's own process."""

from __future__ import annotations

import gc

import torch

from pagoda.executor.base import Executor, PendingOutput
from pagoda.step import ModelRunnerOutput, SchedulerOutput
from pagoda.worker.worker import Worker


class UniProcExecutor(Executor):
    def initialize(self) -> int:
        parallel = self.config.parallel
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(parallel, key) != 1:
                raise ValueError(
                    f"the uniproc executor runs one rank; for parallel.{key}="
                    f"{getattr(parallel, key)} pick multiproc or ray (parallel.executor)"
                )
        self.worker = Worker(self.config, self.info)
        self.worker.load_model()
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        self.startup_times = dict(self.worker.model_runner.startup_times)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def launch(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        return self.worker.model_runner.launch(scheduler_output)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.model_runner.grammar.close()  # its matcher process, if any
        self.worker = None  # type: ignore[assignment]
        if torch.cuda.is_initialized():
            # NOTE: the KV cache is most of the device; free it now, not at the interpreter's
            # next full collection (graph captures can tie it into reference cycles), and hand
            # the cached blocks back so that another engine in this process can profile them.
            gc.collect()
            torch.cuda.empty_cache()
