"""The executor interface: how the engine core reaches its workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from pagoda.config import EngineConfig
from pagoda.engine.model_info import ModelInfo
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput


class PendingOutput(Protocol):
    def get(self) -> ModelRunnerOutput: ...


class _Done:
    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def get(self) -> ModelRunnerOutput:
        return self._output


class Executor(ABC):
    """Runs the workers of one engine. Registered by name through ``register_executors``."""

    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self.config = config
        self.info = info
        # Seconds per start-up phase (load_weights_s, profile_s, kv_cache_s, graph_capture_s),
        # filled by ``initialize``; the slowest worker's where there are several.
        self.startup_times: dict[str, float] = {}

    @abstractmethod
    def initialize(self) -> int:
        """Load the model on every worker, size and allocate the KV cache; return its blocks."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def launch(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Start a step and return at once; ``get()`` on the result waits for its output.

        The engine launches step N+1 before it reads step N's output (async scheduling), so an
        executor that overrides this must let step N+1 take step N's sampled ids on its workers.
        The default runs the step to the end first.
        """
        return _Done(self.execute_model(scheduler_output))

    def shutdown(self) -> None:  # noqa: B027 (optional to override)
        """Release workers and their memory."""
