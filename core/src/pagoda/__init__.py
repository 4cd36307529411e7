"""Pagoda: an LLM inference and serving engine with a plugin at every seam."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagoda.cpu_threads import set_wait_policy
from pagoda.plugins.hookspecs import hookimpl
from pagoda.version import __version__

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.entrypoints.llm import LLM
    from pagoda.lora_request import LoRARequest
    from pagoda.outputs import CompletionOutput, RequestOutput
    from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

# The package face's other names, imported when first asked for: plugin discovery imports
# ``pagoda`` (for ``hookimpl``) in every process, and needs none of them.
_LAZY = {
    "EngineConfig": "pagoda.config",
    "LoRARequest": "pagoda.lora_request",
    "CompletionOutput": "pagoda.outputs",
    "RequestOutput": "pagoda.outputs",
    "SamplingParams": "pagoda.sampling_params",
    "StructuredOutputsParams": "pagoda.sampling_params",
}

__all__ = [
    "__version__",
    "LLM",
    "AsyncLLM",
    "EngineConfig",
    "SamplingParams",
    "LoRARequest",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    # Lazy: `import pagoda` (and plugin discovery) must not pull in torch.
    if name == "LLM":
        set_wait_policy()  # before torch loads OpenMP (pagoda.cpu_threads)
        from pagoda.entrypoints.llm import LLM

        return LLM
    if name == "AsyncLLM":
        set_wait_policy()
        from pagoda.engine.async_llm import AsyncLLM

        return AsyncLLM
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # (once: later lookups find it without this function)
        return value
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
