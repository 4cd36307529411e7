"""A worker owns one device: it loads the model there, holds the KV cache, and runs steps."""

from __future__ import annotations

import logging
import os

import torch

from pagoda.config import EngineConfig
from pagoda.cpu_threads import allowed_cpus, choose_threads
from pagoda.model_info import ModelInfo
from pagoda.quantization import build_quantization
from pagoda.step import ModelRunnerOutput, SchedulerOutput
from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self.config = config
        self.info = info
        torch.manual_seed(config.model.seed)
        set_cpu_threads(config, info.device)
        if info.device.type == "cuda":
            torch.cuda.set_device(info.device)
        self.model_runner = ModelRunner(
            config,
            info.shape,
            info.hf_dir,
            info.load_format,
            info.device,
            info.dtype,
            info.max_model_len,
            info.max_num_batched_tokens,
            model_impl=info.model_impl,
            pooler=info.pooler,
            quantization=build_quantization(info.quantization, info.quantization_config),
        )

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)


def set_cpu_threads(config: EngineConfig, device: torch.device) -> int:
    """Size torch's CPU pool for this engine process (``pagoda.cpu_threads`` says how) and log
    the choice; returns the thread count."""
    cpus = allowed_cpus()
    parallel = config.parallel
    ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    # NOTE: data-parallel cores share the machine's CPUs too.
    processes = (ranks if device.type == "cpu" else 1) * parallel.data_parallel_size
    threads, why = choose_threads(
        cpus, processes, gpu=device.type == "cuda", configured=config.model.cpu_threads
    )
    wait = os.environ.get("OMP_WAIT_POLICY", "the OpenMP default")
    logger.info("torch CPU threads: %d (%s; OpenMP wait policy: %s)", threads, why, wait)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads
