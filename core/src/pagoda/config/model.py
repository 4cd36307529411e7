"""Engine configuration: one pydantic-settings model with a section per concern.

Sources, highest first: explicit arguments, command-line flags, environment (``PAGODA_`` prefix,
``__`` between section and key), a YAML or TOML file, defaults. Unknown keys are errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    model: str | None = Field(
        None, description="Hugging Face model folder, GGUF file, or None for the default model"
    )
    tokenizer: str | None = Field(None, description="tokenizer source; defaults to the model's")
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    max_model_len: int | None = Field(None, ge=1, description="context limit; default: model's")
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    trust_remote_code: bool = False


class CacheConfig(_Section):
    block_size: int = Field(16, ge=1, le=1024)
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV cache size; default: 4 GiB on CPU, from utilization on GPU"
    )
    num_gpu_blocks_override: int | None = Field(None, ge=1)


class SchedulerConfig(_Section):
    max_num_seqs: int = Field(128, ge=1)
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="token budget per step; default 2048 (or max_model_len if larger"
        " and chunked prefill is off)",
    )
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"


class AttentionConfig(_Section):
    backend: str = "auto"


class ParallelConfig(_Section):
    tensor_parallel_size: int = Field(1, ge=1)
    executor: str = "uniproc"


class SpeculativeConfig(_Section):
    method: str | None = None
    num_speculative_tokens: int = Field(0, ge=0)


class StructuredOutputConfig(_Section):
    backend: str = "auto"


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    served_model_name: str | None = None


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

    @model_validator(mode="after")
    def _check_cross_fields(self) -> EngineConfig:
        s = self.scheduler
        if s.max_num_batched_tokens is not None and s.max_num_batched_tokens < s.max_num_seqs:
            if s.max_num_batched_tokens < 1:
                raise ValueError("scheduler.max_num_batched_tokens must be at least 1")
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
        return init_settings, env_settings

    @classmethod
    def load(
        cls,
        config_file: str | Path | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> EngineConfig:
        """Build the configuration from a file, the environment and explicit overrides.

        ``overrides`` may be nested (``{"cache": {"block_size": 32}}``) or flat with vLLM's
        argument names (``{"block_size": 32, "max_model_len": 2048}``).
        """
        file_values = _read_config_file(config_file) if config_file else {}
        explicit = nest_flat_overrides(overrides or {})
        merged = _deep_merge(file_values, explicit)
        try:
            return cls(**merged)
        except ValidationError as e:
            raise ConfigError(_format_errors(e)) from None


def _section_fields() -> dict[str, str]:
    """Map each key name to its section, for flat (vLLM-style) arguments."""
    out: dict[str, str] = {}
    for section, info in EngineConfig.model_fields.items():
        for key in info.annotation.model_fields:  # type: ignore[union-attr]
            out.setdefault(key, section)
    return out


def nest_flat_overrides(values: dict[str, Any]) -> dict[str, Any]:
    sections = EngineConfig.model_fields
    flat_map = _section_fields()
    nested: dict[str, Any] = {}
    for key, value in values.items():
        if key in sections and isinstance(value, dict):
            nested[key] = _deep_merge(nested.get(key, {}), value)
        elif key in flat_map:
            nested.setdefault(flat_map[key], {})[key] = value
        else:
            known = ", ".join(sorted(flat_map))
            raise ConfigError(f"unknown engine argument {key!r}; known arguments: {known}")
    return nested


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    text = p.read_text()
    try:
        if p.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:
        raise ConfigError(f"config file {str(p)!r} could not be parsed: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    return data


def _format_errors(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        lines.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
    return "invalid configuration:\n  " + "\n  ".join(lines)
