"""Engine configuration: data, its sources and their precedence; it never asks a registry.

Inside, lowest first: ``errors.py`` (ConfigError), ``model.py`` (the sections),
``plugin_settings.py`` (the ``plugins`` section's values), ``files.py`` (YAML and TOML),
``loader.py`` (sources and precedence), ``engine.py`` (``EngineConfig``), ``reference.py``
(the generated key reference). See ``docs/configuration.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagoda.config.errors import ConfigError

if TYPE_CHECKING:
    from pagoda.config.engine import EngineConfig
    from pagoda.config.model import (
        AttentionConfig,
        CacheConfig,
        LoRAConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        ServerConfig,
        SpeculativeConfig,
        StructuredOutputConfig,
    )

__all__ = [
    "AttentionConfig",
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "StructuredOutputConfig",
    "nest_flat_overrides",
]

# NOTE: the models are built on first use: pydantic and its schemas cost about 0.3 s, which
# plugin discovery (it imports ``plugin_settings``, a cheap module of this package) must not pay.
_LAZY = {
    "EngineConfig": "pagoda.config.engine",
    **dict.fromkeys(
        [
            "AttentionConfig",
            "CacheConfig",
            "LoRAConfig",
            "ModelConfig",
            "ParallelConfig",
            "SchedulerConfig",
            "ServerConfig",
            "SpeculativeConfig",
            "StructuredOutputConfig",
        ],
        "pagoda.config.model",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagoda.config' has no attribute {name!r}")


def nest_flat_overrides(values: dict) -> dict:
    """Flat (vLLM-style) or nested engine arguments -> ``{section: {key: value}}``."""
    # NOTE: the loader builds the models (above): on first use.
    from pagoda.config.loader import explicit_layer

    return explicit_layer(values).values
