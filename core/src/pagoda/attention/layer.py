"""The attention module that models use, and the per-step forward context that feeds it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.spec import AttentionSpec
from pagoda.loader.sharded import WeightSlice, as_slice
from pagoda.ops.fp8 import FP8_MAX

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
    """Paged attention for one layer: the model gives it projected q, k, v for the flat batch.

    ``spec`` says what the layer computes (None: plain causal attention of ``num_heads``,
    ``head_size``, ``scale`` and ``num_kv_heads``, which a given spec must repeat). A spec with
    ``sinks`` gives the layer a ``sinks`` parameter (``[num_heads]``, this rank's heads, in the
    model's dtype) for the weights to fill; its impl reads it as ``impl.sinks``.

    Its KV scales, ``k_scale`` and ``v_scale`` (float32 ``[1]`` buffers, 1.0 unless loaded or
    computed), are what an FP8 KV cache divides keys and values by when it stores them; its
    impl reads them as ``impl.k_scale`` and ``impl.v_scale``. With ``calibrate_kv_scales`` set
    (the model runner sets it once the cache is bound), the next forward computes them from its
    keys and values first, then clears it.
    """

    def __init__(
        self,
        backend: type[AttentionBackend],
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        spec: AttentionSpec | None = None,
    ) -> None:
        super().__init__()
        plain = AttentionSpec(num_heads, num_kv_heads, head_size, scale)
        if spec is None:
            spec = plain
        elif (spec.num_heads, spec.num_kv_heads, spec.head_size, spec.scale) != (
            num_heads,
            num_kv_heads,
            head_size,
            scale,
        ):
            raise ValueError(f"layer {layer_idx}: {spec} disagrees with its arguments {plain}")
        missing = backend.unsupported(spec)
        if missing is not None:
            raise ValueError(
                f"attention backend {backend.name!r} does not support {missing}, which layer "
                f"{layer_idx} needs ({spec})"
            )
        self.spec = spec
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.v_head_size = spec.v_head_size
        self.layer_idx = layer_idx
        self.impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads)
        self.impl.spec = spec
        if spec.sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False)
            self.impl.sinks = self.sinks
        # Bound by the model runner once the cache is allocated.
        self.kv_cache: torch.Tensor = torch.empty(0)
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.impl.k_scale, self.impl.v_scale = self.k_scale, self.v_scale
        self.kv_scales_loaded = False
        self.calibrate_kv_scales = False

    def load_kv_scale(self, which: str, scale: torch.Tensor | WeightSlice) -> None:
        """Set the key (``which="k"``) or value (``"v"``) scale from a checkpoint's tensor (one
        value)."""
        value = as_slice(scale).full().float().reshape(-1)
        if value.numel() != 1:
            raise ValueError(
                f"layer {self.layer_idx}: a KV scale is one value, the checkpoint's {which}_scale "
                f"has {value.numel()}"
            )
        with torch.no_grad():
            (self.k_scale if which == "k" else self.v_scale).copy_(value)
        self.kv_scales_loaded = True

    @torch.no_grad()
    def _calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        # NOTE: half the format's range: later tokens may reach past the first prompt's largest
        # value (they are clamped there) without saturating at once.
        for t, scale in ((k, self.k_scale), (v, self.v_scale)):
            scale.copy_((t.abs().amax().float() / (FP8_MAX / 2)).clamp(min=1e-6).reshape(1))
        self.calibrate_kv_scales = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        if self.calibrate_kv_scales:
            self._calibrate(k, v)
        out = self.impl.forward(
            q.view(n, self.num_heads, self.head_size),
            k.view(n, self.num_kv_heads, self.head_size),
            v.view(n, self.num_kv_heads, self.v_head_size),
            self.kv_cache,
            _attn_metadata,
        )
        return out.reshape(n, self.num_heads * self.v_head_size)
