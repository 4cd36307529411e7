"""``native``: the core's own implementations (the Llama family), as a model impl."""

from __future__ import annotations

from typing import Any

from pagoda.loader.arch import ModelArchConfig, architecture_of
from pagoda.models.impl import ModelImpl
from pagoda.plugins import get_registry


class NativeModelImpl(ModelImpl):
    """The architectures of ``pagoda.loader.arch.SUPPORTED_ARCHITECTURES``, each built from the
    class that ``register_models`` registered under its name (a plugin may override one)."""

    priority = 100

    @classmethod
    def supports(cls, hf_config: dict[str, Any], architecture: str) -> str | None:
        try:
            architecture_of(hf_config)
        except ValueError as e:
            return str(e)
        return None

    @classmethod
    def arch_config(cls, hf_config: dict[str, Any]) -> ModelArchConfig:
        return ModelArchConfig.from_hf_config(hf_config)

    @classmethod
    def model_class(cls, arch: ModelArchConfig) -> Any:
        return get_registry("models").get(arch.architecture)
