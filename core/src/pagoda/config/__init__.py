"""Engine configuration: the model (``model.py``), its sources and their precedence
(``loader.py``), configuration files (``files.py``). See ``docs/configuration.md``."""

from pagoda.config.model import (
    AttentionConfig,
    CacheConfig,
    ConfigError,
    EngineConfig,
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
    from pagoda.config.loader import explicit_layer

    return explicit_layer(values).values
