"""Model loading: resolve `model=` to a Hugging Face folder, parse its config, yield its weights.

Floor: leaves. It imports no other part of Pagoda; torch, transformers and gguf load where used.
"""

from __future__ import annotations

from pagoda.loader.arch import SUPPORTED_ARCHITECTURES, ArchTraits, ModelArchConfig
from pagoda.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from pagoda.loader.gguf_loader import cache_dir, convert_gguf
from pagoda.loader.resolve import ResolvedModel, load_hf_config, load_tokenizer, resolve_model
from pagoda.loader.weights import init_dummy_, iter_safetensors, safetensors_files

__all__ = [
    "DEFAULT_MODEL_NAME",
    "SUPPORTED_ARCHITECTURES",
    "ArchTraits",
    "ModelArchConfig",
    "ResolvedModel",
    "cache_dir",
    "convert_gguf",
    "default_model_path",
    "init_dummy_",
    "iter_safetensors",
    "load_hf_config",
    "load_tokenizer",
    "resolve_model",
    "safetensors_files",
]
