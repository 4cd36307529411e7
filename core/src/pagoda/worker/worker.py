"""A worker owns one device: it loads the model there, holds the KV cache, and runs steps."""

from __future__ import annotations

import logging
import os

import torch

from pagoda.config import EngineConfig
from pagoda.model_info import ModelInfo
from pagoda.step import ModelRunnerOutput, SchedulerOutput
from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self.config = config
        self.info = info
        torch.manual_seed(config.model.seed)
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
        )

    def load_model(self) -> None:
        self.model_runner.load_model()
        if self.info.device.type == "cuda":
            limit_cpu_threads()

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)


def limit_cpu_threads() -> None:
    """A GPU engine's host work is scheduling, small copies and the grammar backend's threads;
    torch's CPU thread pool, sized to every core, spins on those cores after each CPU op (as
    vLLM, cap it; OMP_NUM_THREADS chooses instead)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    threads = max(1, min(torch.get_num_threads(), cpus // 4))
    if threads < torch.get_num_threads():
        logger.info("torch CPU threads: %d of %d (GPU engine)", threads, torch.get_num_threads())
        torch.set_num_threads(threads)
