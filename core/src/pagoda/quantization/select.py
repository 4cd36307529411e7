"""Choosing the quantization method: ``model.quantization`` by name, or the checkpoint's own."""

from __future__ import annotations

from typing import Any

import torch

from pagoda.plugins import PluginLoadError, get_registry
from pagoda.quantization.method import QuantizationMethod

KIND = "quantization_methods"
NONE = "none"


def checkpoint_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``quantization_config`` (older compressed-tensors exports:
    ``compression_config``), ``{}`` for a full-precision checkpoint."""
    return dict(hf_config.get("quantization_config") or hf_config.get("compression_config") or {})


def method_class(name: str) -> type[QuantizationMethod]:
    """The class registered as ``name``; an unknown name is an error that lists the known."""
    registry = get_registry(KIND)
    target = registry.get(name)
    if not (isinstance(target, type) and issubclass(target, QuantizationMethod)):
        plugin = registry.registration(name).plugin
        raise PluginLoadError(
            f"quantization method {name!r} from plugin {plugin.label} is {target!r}, not a "
            "subclass of pagoda.quantization.QuantizationMethod"
        )
    return target


def resolve_quantization(
    name: str | None, hf_config: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> str | None:
    """The method that serves the model (None: full precision), checked against the checkpoint
    and the device. ``name`` is ``model.quantization``: None takes the checkpoint's (the method
    whose ``checkpoint_formats`` has its ``quant_method``), ``"none"`` refuses a quantized
    checkpoint, any other is a registered method's name. Raises ValueError, one line, saying
    what is missing."""
    cfg = checkpoint_config(hf_config)
    fmt = cfg.get("quant_method")
    if name is None:
        if not cfg:
            return None
        registry = get_registry(KIND)
        readers = [n for n in registry.names() if fmt in method_class(n).checkpoint_formats]
        if not readers:
            raise ValueError(
                f"the checkpoint is quantized (quant_method {fmt!r}) and no quantization method "
                f"reads it; installed: {', '.join(registry.names()) or 'none'}"
            )
        name = readers[0]
    elif name == NONE:
        if cfg:
            raise ValueError(
                f"the checkpoint is quantized (quant_method {fmt!r}): its weights cannot load in "
                "full precision; leave model.quantization unset to read them"
            )
        return None
    why = method_class(name).unsupported(cfg, device, dtype)
    if why is not None:
        raise ValueError(f"quantization {name!r} cannot run here: {why}")
    return name


def build_quantization(name: str | None, cfg: dict[str, Any]) -> QuantizationMethod | None:
    """The method's instance for a worker (None: full precision); ``cfg`` is the checkpoint's
    ``quantization_config`` (:func:`checkpoint_config`)."""
    return None if name is None else method_class(name)(cfg)
