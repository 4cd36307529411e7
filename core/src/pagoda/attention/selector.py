"""Choosing the attention backend: by name, or the best one that supports the model."""

from __future__ import annotations

import torch

from pagoda.attention.backend import AttentionBackend
from pagoda.plugins import get_registry


def select_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype, head_size: int
) -> type[AttentionBackend]:
    registry = get_registry("attention_backends")
    if name != "auto":
        backend = registry.get(name)
        if not backend.supports(device, dtype, head_size):
            raise ValueError(
                f"attention backend {name!r} does not support device={device.type}, "
                f"dtype={dtype}, head_size={head_size}"
            )
        return backend
    candidates = []
    for n in registry.names():
        try:
            backend = registry.get(n)
        except Exception:  # a backend that cannot even import is skipped by "auto"
            continue
        if backend.supports(device, dtype, head_size):
            candidates.append(backend)
    if not candidates:
        raise ValueError(
            f"no attention backend supports device={device.type}, dtype={dtype}, "
            f"head_size={head_size}; registered: {', '.join(registry.names())}"
        )
    return max(candidates, key=lambda b: b.priority)
