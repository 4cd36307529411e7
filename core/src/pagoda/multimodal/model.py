"""A model's multimodal side, from its model class: whether it takes images and its processor."""

from __future__ import annotations

from typing import Any

from pagoda.model_info import ModelInfo
from pagoda.multimodal.processor import MultiModalProcessor
from pagoda.plugins import get_registry


def _model_class(info: ModelInfo) -> Any:
    return get_registry("model_impls").get(info.model_impl).model_class(info.shape)


def is_multimodal(info: ModelInfo) -> bool:
    """Whether the model's class declares a multimodal processor (it reads images)."""
    return hasattr(_model_class(info), "multimodal_processor")


def build_mm_processor(info: ModelInfo, tokenizer: Any) -> MultiModalProcessor | None:
    """The model's processor (``ModelClass.multimodal_processor(shape_config, model_dir,
    tokenizer)``),
    None for a text-only model."""
    build = getattr(_model_class(info), "multimodal_processor", None)
    return None if build is None else build(info.shape.config, info.hf_dir, tokenizer)
