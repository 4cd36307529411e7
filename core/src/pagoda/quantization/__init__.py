"""Quantized weights and KV caches: the method contract, its selection, FP8.

- ``method.py``: :class:`QuantizationMethod` (what a method provides: whether it serves a
  checkpoint and a device, a :class:`LinearMethod` per layer) and :class:`LinearMethod` (a
  layer's weights: created, loaded, applied).
- ``select.py``: ``model.quantization`` by name, or the checkpoint's ``quantization_config``.
- ``fp8.py``: the core's ``fp8`` method (W8A8: per-channel weights, per-token activations;
  online from a full-precision checkpoint, or compressed-tensors and FBGEMM checkpoints).
- ``kv_cache.py``: ``cache.kv_cache_dtype`` and the checkpoint's KV scales.

Methods are registered through the ``register_quantization_methods`` hook (the core's ``fp8``
too); the kernels are ``pagoda.ops.fp8``. Floor: features (below the worker, beside models).
"""

from __future__ import annotations

from pagoda.quantization.kv_cache import (
    KV_CACHE_DTYPES,
    is_fp8,
    kv_cache_dtype,
    kv_cache_unsupported,
    kv_scale_of,
)
from pagoda.quantization.method import LinearMethod, LinearSlice, QuantizationMethod
from pagoda.quantization.select import (
    KIND,
    build_quantization,
    checkpoint_config,
    method_class,
    resolve_quantization,
)

__all__ = [
    "KIND",
    "KV_CACHE_DTYPES",
    "LinearMethod",
    "LinearSlice",
    "QuantizationMethod",
    "build_quantization",
    "checkpoint_config",
    "finish_loading",
    "is_fp8",
    "kv_cache_dtype",
    "kv_cache_unsupported",
    "kv_scale_of",
    "method_class",
    "resolve_quantization",
]


def finish_loading(model: object) -> None:
    """Let every quantized layer of ``model`` (a module whose ``quant_method`` is set) check and
    prepare what it loaded (:meth:`LinearMethod.finish_loading`)."""
    for module in model.modules():  # type: ignore[attr-defined]
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.finish_loading(module)
