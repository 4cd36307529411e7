"""The attention module that models use, and the per-step forward context that feeds it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend

_attn_metadata: Any = None


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    """Make this step's attention metadata visible to every :class:`Attention` layer."""
    global _attn_metadata
    prev, _attn_metadata = _attn_metadata, attn_metadata
    try:
        yield
    finally:
        _attn_metadata = prev


class Attention(nn.Module):
    """Paged attention for one layer: the model gives it projected q, k, v for the flat batch."""

    def __init__(
        self,
        backend: type[AttentionBackend],
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.layer_idx = layer_idx
        self.impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads)
        # Bound by the model runner once the cache is allocated.
        self.kv_cache: torch.Tensor = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        out = self.impl.forward(
            q.view(n, self.num_heads, self.head_size),
            k.view(n, self.num_kv_heads, self.head_size),
            v.view(n, self.num_kv_heads, self.head_size),
            self.kv_cache,
            _attn_metadata,
        )
        return out.reshape(n, self.num_heads * self.head_size)
