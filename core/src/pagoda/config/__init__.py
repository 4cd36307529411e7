"""Engine configuration: data, its sources and their precedence; it never asks a registry.

Inside, lowest first: ``errors.py`` (ConfigError), ``model.py`` (the sections),
``plugin_settings.py`` (the ``plugins`` section's values), ``files.py`` (YAML and TOML),
``loader.py`` (sources and precedence), ``engine.py`` (``EngineConfig``), ``reference.py``
(the generated key reference). See ``docs/configuration.md``.
"""

from pagoda.config.engine import EngineConfig
from pagoda.config.errors import ConfigError
from pagoda.config.loader import explicit_layer
from pagoda.config.model import (
    AttentionConfig,
    CacheConfig,
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
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "StructuredOutputConfig",
    "nest_flat_overrides",
]


def nest_flat_overrides(values: dict) -> dict:
    """Flat (vLLM-style) or nested engine arguments -> ``{section: {key: value}}``."""
    return explicit_layer(values).values
