"""The attention module that models use, and the per-step forward context that feeds it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend, kv_stored_by_model, write_kv_cache
from pagoda.attention.spec import AttentionSpec
from pagoda.loader.sharded import WeightSlice, as_slice
from pagoda.ops.fp8 import FP8_MAX

_attn_metadata: Any = None
_slot_mapping: torch.Tensor | None = None
_kept_metadata: Any = None
_kv_unread = False
_split: Callable[..., torch.Tensor] | None = None


@contextmanager
def set_forward_context(
    attn_metadata: Any,
    slot_mapping: torch.Tensor | None = None,
    kept_metadata: Any = None,
    kv_unread: bool = False,
) -> Iterator[None]:
    """Make this step's attention metadata visible to every :class:`Attention` layer; with
    ``slot_mapping`` (the step's, a slot for each of its tokens), a layer may let the model
    store its keys and values itself (:meth:`Attention.kv_store_target`). ``kept_metadata``:
    the backend's metadata of one row a request alone (its last; in a bidirectional model, any),
    as a step of one query a request over the same contexts
    (:meth:`CommonAttentionMetadata.kept_rows`), where the model reads only those rows of its
    last layer (``Attention.forward``'s ``keep``). ``kv_unread``: no later step reads the keys
    and values this step computes (the scheduler's ``SchedulerOutput.kv_unread``), so a layer
    whose attention reads none of them from the cache skips storing them
    (:meth:`Attention.stores_kv`)."""
    global _attn_metadata, _slot_mapping, _kept_metadata, _kv_unread
    prev = _attn_metadata, _slot_mapping, _kept_metadata, _kv_unread
    _attn_metadata, _slot_mapping, _kept_metadata = attn_metadata, slot_mapping, kept_metadata
    _kv_unread = kv_unread
    try:
        yield
    finally:
        _attn_metadata, _slot_mapping, _kept_metadata, _kv_unread = prev


@contextmanager
def split_at_attention(split: Callable[..., torch.Tensor] | None) -> Iterator[None]:
    """Inside, every :class:`Attention` layer's ``forward`` attends to nothing: it returns
    ``split(layer, q, k, v, kv_stored)``, which stands in for its output (``[num_tokens,
    num_heads * v_head_size]``). The runner's piecewise CUDA graphs end a graph there and run
    the layer eagerly between two replays (``pagoda.worker.piecewise_graphs``). None: layers
    attend (inside a split, to run one)."""
    global _split
    prev, _split = _split, split
    try:
        yield
    finally:
        _split = prev


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
        self.backend = backend
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

    def kv_store_target(
        self, num_tokens: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a model's kernel may store this step's keys and values itself, as it computes
        them: this layer's cache (``[2, num_blocks, block_size, num_kv_heads, head_size]``,
        contiguous) and the step's slot mapping (a slot for each of ``num_tokens`` rows; below
        zero: none). Only where the backend accepts it (``accepts_model_stored_kv``), the cache
        is in ``dtype`` (no FP8, no scales to calibrate), keys and values have one head size,
        and the runner gave the step's slots; None elsewhere. A model that stored them passes
        ``kv_stored=True`` to :meth:`forward`."""
        cache, slots = self.kv_cache, _slot_mapping
        if (
            not self.backend.accepts_model_stored_kv
            or slots is None
            or slots.shape[0] != num_tokens
            or self.calibrate_kv_scales
            or self.v_head_size != self.head_size
            or cache.dtype != dtype
            or cache.dim() != 5
            or cache.shape[0] != 2
            or cache.shape[-2:] != (self.num_kv_heads, self.head_size)
            or not cache.is_contiguous()
        ):
            return None
        return cache, slots

    def stores_kv(self, keep: torch.Tensor | None = None) -> bool:
        """Whether this step's keys and values go into this layer's cache. Not where no later
        step reads them (the runner's ``kv_unread``: a step of pooling prompts computed whole,
        whose blocks the prefix cache does not keep) and this layer's attention reads none of
        them from the cache either: its impl attends over the keys and values it is given
        (``AttentionImpl.attends_from_inputs``, asked of a backend that says
        ``accepts_model_stored_kv``), and its kept rows (``keep``, the last layer's) do not
        attend through the cache. A model whose kernel would store them asks this first; the
        layer's ``forward`` then writes nothing either."""
        if not _kv_unread or (keep is not None and _kept_metadata is not None):
            return True
        return not (
            self.backend.accepts_model_stored_kv
            and self.impl.attends_from_inputs(self.kv_cache, _attn_metadata)
        )

    def attends_kept_rows(self, num_tokens: int, dtype: torch.dtype) -> bool:
        """Whether this step's kept rows (``forward``'s ``keep``) attend as a step of their own:
        the runner gave their metadata, and the keys and values of the step's ``num_tokens``
        rows go into the cache first (by the model's kernel or the layer's write: see
        :meth:`kv_store_target`). Then the model may hand ``forward`` the kept rows' queries
        alone."""
        return _kept_metadata is not None and self.kv_store_target(num_tokens, dtype) is not None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_stored: bool = False,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``kv_stored``: the model stored ``k`` and ``v`` in the cache itself, where
        :meth:`kv_store_target` said (the impl does not write them again).

        ``keep``: the rows whose output is read (one a request, its last; the output has those
        rows alone). Every row's keys and values are still cached. Where the runner gave
        the kept rows' metadata and the cache takes the default write, only the kept rows'
        queries attend, as a step of one query a request over the cached contexts (a decode
        step's work, not a prefill's); ``q`` may then hold the kept rows' queries alone (where
        :meth:`attends_kept_rows` said so). Elsewhere every row attends and the kept rows are
        picked from the output. A bidirectional layer's kept row may be any of its request's
        (its keys are all of them either way)."""
        if _split is not None:
            if keep is not None:
                raise ValueError("a step split at its attention layers keeps every row")
            return _split(self, q, k, v, kv_stored)
        n = q.shape[0]
        if self.calibrate_kv_scales:
            self._calibrate(k, v)
        if not kv_stored and not self.stores_kv(keep):
            kv_stored = True  # (nothing to store: no step reads them, nor this one's attention)
        md = _attn_metadata
        if keep is not None and _kept_metadata is not None:
            target = None if kv_stored else self.kv_store_target(k.shape[0], k.dtype)
            if kv_stored or target is not None:
                if target is not None:  # every row's keys and values, before the kept attend
                    rows = k.shape[0]
                    write_kv_cache(
                        k.view(rows, self.num_kv_heads, self.head_size),
                        v.view(rows, self.num_kv_heads, self.v_head_size),
                        *target,
                        rows,
                    )
                if n != keep.shape[0]:
                    q = q[keep]
                k, v = k[keep], v[keep]
                md, kv_stored, n, keep = _kept_metadata, True, keep.shape[0], None
        if keep is not None and n != k.shape[0]:
            raise ValueError(
                f"q has {n} rows, k {k.shape[0]}: the kept rows' queries alone need the step's "
                "kept-rows metadata and keys and values the model stored (attends_kept_rows)"
            )
        with kv_stored_by_model() if kv_stored else nullcontext():
            out = self.impl.forward(
                q.view(n, self.num_heads, self.head_size),
                k.view(n, self.num_kv_heads, self.head_size),
                v.view(n, self.num_kv_heads, self.v_head_size),
                self.kv_cache,
                md,
            )
        out = out.reshape(n, self.num_heads * self.v_head_size)
        return out if keep is None else out[keep]
