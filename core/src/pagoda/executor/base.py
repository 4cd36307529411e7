"""The executor interface: how the engine core reaches its workers.

The engine core builds one executor (``parallel.executor``, by name from the ``executors``
registry) and calls, in this order:

1. ``__init__(config, info)``: once; nothing heavy yet.
2. ``initialize()``: once; start the workers, load the model on each, size the KV cache (the
   smallest number of blocks any worker can hold), allocate it, capture graphs; return the
   number of blocks. ``startup_times`` is read right after.
3. ``launch(scheduler_output)``: once per step, from one thread, in step order; ``get()`` on its
   result is called exactly once per launch and in launch order, at most one step later (the
   engine launches step N+1 before it reads step N: async scheduling; with pipeline parallelism
   up to ``pipeline_parallel_size`` steps are in flight, each read in launch order).
   ``execute_model`` is the same without the overlap.
4. ``shutdown()``: once, also after an error; it must leave no process or device memory behind.

An executor whose worker dies or hangs raises from ``get()`` (or ``initialize``) within seconds,
with a message that names the worker; the engine then fails the requests in flight.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

from pagoda.config import EngineConfig
from pagoda.model_info import ModelInfo
from pagoda.step import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagoda.config.model import ParallelConfig


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
        """Called once, by the engine core, before ``initialize``: ``config`` is the engine's
        configuration, ``info`` what was derived from it and the model files (device, dtype,
        limits). Start nothing heavy here."""
        self.config = config
        self.info = info
        # Seconds per start-up phase (load_weights_s, profile_s, kv_cache_s, graph_capture_s),
        # filled by ``initialize``; the slowest worker's where there are several.
        self.startup_times: dict[str, float] = {}

    @abstractmethod
    def initialize(self) -> int:
        """Load the model on every worker, size and allocate the KV cache; return its blocks."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step ``scheduler_output`` on every worker and wait for it. Returns the
        :class:`ModelRunnerOutput` of the rank that samples (rank 0; with pipeline parallelism
        the first rank of the last stage): the sampled ids (and logprobs) of the step's
        requests."""

    def launch(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Start the step ``scheduler_output`` and return at once. Returns a
        :class:`PendingOutput`; its ``get()`` waits for the step's ``ModelRunnerOutput``.

        The engine launches step N+1 before it reads step N's output (async scheduling), so an
        executor that overrides this must let step N+1 take step N's sampled ids on its workers.
        The default runs the step to the end first.
        """
        return _Done(self.execute_model(scheduler_output))

    def shutdown(self) -> None:  # noqa: B027 (optional to override)
        """Release workers and their memory. Called once, when the engine shuts down. Returns
        nothing."""


# vLLM's names (``distributed_executor_backend``) for the executors Pagoda ships.
_VLLM_NAMES = {"mp": "multiproc", "uni": "uniproc"}


def executor_name(parallel: ParallelConfig) -> str:
    """``parallel.executor``, with ``auto`` resolved: uniproc for one rank, multiproc for more."""
    if parallel.executor != "auto":
        return _VLLM_NAMES.get(parallel.executor, parallel.executor)
    ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    return "uniproc" if ranks == 1 else "multiproc"
