"""The executor interface: how the engine core reaches its workers."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagoda.config import EngineConfig
from pagoda.engine.model_info import ModelInfo
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Runs the workers of one engine. Registered by name through ``register_executors``."""

    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self.config = config
        self.info = info

    @abstractmethod
    def initialize(self) -> int:
        """Load the model on every worker, size and allocate the KV cache; return its blocks."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:  # noqa: B027 (optional to override)
        """Release workers and their memory."""
