"""Whether the engine can serve LoRA with this model and configuration (checked at start)."""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.model_info import ModelInfo
from pagoda.plugins import get_registry


def check_lora(config: EngineConfig, info: ModelInfo) -> None:
    """Raise ValueError, naming the key or the model impl, where LoRA cannot be served."""
    if not config.lora.enable_lora:
        if config.server.lora_modules:
            raise ValueError(
                "server.lora_modules (--lora-modules) needs lora.enable_lora (--enable-lora)"
            )
        return
    model_cls = get_registry("model_impls").get(info.model_impl).model_class(info.shape)
    if not getattr(model_cls, "supports_lora", False):
        raise ValueError(
            f"LoRA (lora.enable_lora) is served by the native model impl (the Llama family); "
            f"model.impl {info.model_impl!r} ({info.shape.architecture}, "
            f"{model_cls.__name__}) does not support adapters"
        )
    if config.model.batch_invariant:
        raise ValueError(
            "lora.enable_lora with model.batch_invariant is not supported (the LoRA kernels'"
            " results depend on whether a row is decoded or prefilled); unset one of them"
        )
    if config.speculative.method is not None:
        raise ValueError(
            "lora.enable_lora with speculative decoding (speculative.method="
            f"{config.speculative.method!r}) is not supported; unset one of them"
        )
