"""Choosing the attention backend: by name, or ``auto``, the best one that supports the model."""

from __future__ import annotations

from typing import Any

import torch

from pagoda.attention.backend import AttentionBackend
from pagoda.plugins import PluginLoadError, get_registry, select


def select_attention_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_size: int,
    block_size: int = 16,
) -> type[AttentionBackend]:
    """The backend class named ``name`` (``attention.backend``), checked to support ``device``,
    ``dtype``, ``head_size`` and ``block_size``; ``auto`` picks the highest ``priority`` among
    those that do."""
    return select(
        "attention_backends",
        name,
        supports=lambda b: (
            b.supports(device, dtype, head_size) and b.supports_block_size(block_size)
        ),
        needs=f"device={device.type}, dtype={str(dtype).removeprefix('torch.')}, "
        f"head_size={head_size}, block_size={block_size}",
        check=_check_backend,
    )


def _check_backend(name: str, target: Any) -> None:
    if not (isinstance(target, type) and issubclass(target, AttentionBackend)):
        plugin = get_registry("attention_backends").registration(name).plugin
        raise PluginLoadError(
            f"attention backend {name!r} from plugin {plugin.label} is {target!r}, not a "
            "subclass of pagoda.attention.backend.AttentionBackend"
        )
