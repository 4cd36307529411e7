"""The engine configuration: one pydantic-settings model with a section per concern
(``pagoda.config.model``).

``EngineConfig.load`` layers the sources (see ``pagoda.config.loader``); constructing
``EngineConfig()`` directly reads explicit arguments and the environment only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, PrivateAttr, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from pagoda.config import loader, plugin_settings
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


class EngineConfig(BaseSettings):
    """Everything an engine needs to start. ``EngineConfig.load`` is the usual entry point."""

    model_config = SettingsConfigDict(
        env_prefix="PAGODA_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    structured_output: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)

    # Dotted key -> where its value came from ("file engine.yaml, line 3", "default", ...).
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)
    # The ``plugins`` section: plugin name -> the settings given (checked by its model).
    _plugin_values: dict[str, dict[str, Any]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check_cross_fields(self) -> EngineConfig:
        # the rules the configuration alone decides
        self.speculative.check(
            tensor_parallel_size=self.parallel.tensor_parallel_size,
        )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        if loader.LAYERED.get():
            return (init_settings,)
        return init_settings, env_settings

    @classmethod
    def load(
        cls,
        config_file: str | Path | None = None,
        overrides: dict[str, Any] | None = None,
        *,
        flags: dict[str, tuple[Any, str]] | None = None,
    ) -> EngineConfig:
        """Build the configuration from its sources, highest first: ``overrides`` (explicit
        arguments), ``flags`` (command line), the environment (``PAGODA_SECTION__KEY``),
        ``config_file`` (YAML or TOML), defaults.

        ``overrides`` may be nested (``{"cache": {"block_size": 32}}``) or flat with vLLM's
        argument names (``{"block_size": 32}``). ``flags`` maps ``"section.key"`` to the value and
        the flag that gave it. Raises :class:`ConfigError` naming each bad key and its source.
        """
        return loader.load_config(cls, config_file, overrides, flags)

    def with_overrides(self, overrides: dict[str, Any]) -> EngineConfig:
        """A copy with explicit ``overrides`` (nested or flat) on top, sources kept."""
        return loader.apply_overrides(self, overrides)

    @property
    def sources(self) -> dict[str, str]:
        """Every key (``section.key``) -> the source its value came from."""
        out = {k: self._sources.get(k, "default") for k in loader.leaf_keys()}
        out.update((k, v) for k, v in self._sources.items() if k.startswith("plugins."))
        return out

    def plugin_settings(self, name: str) -> BaseModel:
        """The settings of plugin ``name``: its registered model (``register_plugin_settings``)
        with the values of the ``plugins.<name>`` section, defaults for the rest."""
        return plugin_settings.checker().settings_of(name, self._plugin_values.get(name, {}))

    def source_of(self, key: str) -> str:
        """Where the value of ``key`` (``"cache.block_size"``) came from."""
        sources = self.sources
        if key not in sources:
            raise KeyError(f"unknown configuration key {key!r}")
        return sources[key]
