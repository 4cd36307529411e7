"""The KV cache's dtype (``cache.kv_cache_dtype``) and where a checkpoint keeps its KV scales.

``auto`` stores keys and values in the model's dtype. ``fp8`` (or ``fp8_e4m3``) stores each as
FP8 e4m3 with one float32 scale per layer for keys and one for values (``q = fp8(k / k_scale)``):
half the bytes of bf16, so twice the tokens in the same memory and half the reads a decode step
makes. The scales come from the checkpoint where it has them (compressed-tensors'
``kv_cache_scheme``: ``self_attn.k_scale`` and ``v_scale``; older exports:
``k_proj.output_scale``), else each layer computes its own from the first prompt it sees
(``cache.calculate_kv_scales``), else they are 1.0.
"""

from __future__ import annotations

import torch

from pagoda.ops.fp8 import FP8_DTYPE, fp8_unsupported

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": FP8_DTYPE,
    "fp8_e4m3": FP8_DTYPE,
}

# Checkpoint name endings -> which scale of the layer's attention they are.
_SCALE_NAMES = {
    "self_attn.k_scale": "k",
    "self_attn.v_scale": "v",
    "self_attn.k_proj.output_scale": "k",
    "self_attn.v_proj.output_scale": "v",
    "self_attn.attn.k_scale": "k",
    "self_attn.attn.v_scale": "v",
}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for ``cache.kv_cache_dtype`` = ``name``."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"cache.kv_cache_dtype={name!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return KV_CACHE_DTYPES[name] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def kv_cache_unsupported(name: str, device: torch.device) -> str | None:
    """None when a KV cache of ``cache.kv_cache_dtype`` = ``name`` runs on ``device``, else why
    not (FP8 needs a GPU of compute capability 8.9 or more, or a CPU), one line."""
    if KV_CACHE_DTYPES.get(name) is None:
        return None
    why = fp8_unsupported(device)
    return None if why is None else f"cache.kv_cache_dtype={name}: {why}"


def kv_scale_of(name: str) -> tuple[str, str] | None:
    """For a checkpoint tensor holding a layer's KV scale, (the layer's attention module path,
    ``"k"`` or ``"v"``): ``model.layers.3.self_attn.k_scale`` -> (``model.layers.3.self_attn
    .attn``, ``"k"``); None for any other tensor."""
    for ending, which in _SCALE_NAMES.items():
        if name.endswith("." + ending):
            return name[: -len(ending)] + "self_attn.attn", which
    return None
