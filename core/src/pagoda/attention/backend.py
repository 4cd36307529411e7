"""The attention backend interface: what a backend plugin implements.

A backend is a class registered by name through the ``register_attention_backends`` hook. The
model runner builds one :class:`CommonAttentionMetadata` per step (never per layer); the backend
turns it into its own metadata once, and each layer's :class:`AttentionImpl` reads that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from pagoda import ops
from pagoda.attention.spec import AttentionSpec
from pagoda.config import AttentionConfig
from pagoda.ops.fp8 import FP8_DTYPE, from_fp8, to_fp8


@dataclass
class CommonAttentionMetadata:
    """The flat batch of one step, as every backend receives it.

    Tokens of request ``i`` are ``query_start_loc[i]:query_start_loc[i + 1]`` of the flat batch;
    the request's context holds ``seq_lens[i]`` tokens including them, so its first query token sits
    at position ``seq_lens[i] - query_len[i]``. ``slot_mapping[t]`` is the KV cache slot
    (``block_id * block_size + offset``) where token ``t`` is written; ``block_table[i]`` lists the
    request's blocks, padded with block 0 (a block the pool never hands out).
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_reqs] int32, on the device
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on the device
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, on the device
    query_start_loc_cpu: np.ndarray  # the same, host copies for planning without a sync
    seq_lens_cpu: np.ndarray
    block_size: int

    def kept_rows(
        self, rows: torch.Tensor, query_start_loc: torch.Tensor
    ) -> CommonAttentionMetadata:
        """One row of each request alone, as a step of one query a request over the same
        contexts (each query at its request's position ``seq_lens[i] - 1``, every key and value
        in the cache by then): a request's last token, or in a bidirectional layer (whose
        queries see every key) any of its tokens. ``rows``: those rows of this step (int64, on
        the device); ``query_start_loc``: ``0 .. num_reqs`` (int32, on the device)."""
        n = self.num_reqs
        return CommonAttentionMetadata(
            num_reqs=n,
            num_actual_tokens=n,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            query_start_loc=query_start_loc[: n + 1],
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            slot_mapping=self.slot_mapping.index_select(0, rows),
            query_start_loc_cpu=np.arange(n + 1, dtype=np.int64),
            seq_lens_cpu=self.seq_lens_cpu,
            block_size=self.block_size,
        )


class AttentionImpl(ABC):
    """One attention layer's computation over the paged KV cache.

    Besides the constructor's arguments, the layer sets these attributes before the first step:
    ``spec``, the layer's :class:`AttentionSpec` (one the backend's ``unsupported`` accepted);
    ``sinks``, the ``[num_heads]`` sink logits (the layer's ``sinks`` parameter, loaded with the
    weights: the model's dtype, the engine's device) when ``spec.sinks``, else None; and
    ``k_scale`` and ``v_scale``, float32 ``[1]`` tensors on the engine's device: with an FP8
    cache (``kv_cache.dtype`` is ``float8_e4m3fn``, only where the backend's
    ``supports_kv_cache_dtype`` said so) keys are stored as ``fp8(key / k_scale)`` and read back
    as ``stored * k_scale``, values likewise. Read them on the device, every step: their values
    may change after a CUDA graph is captured (the first prompt computes them).
    """

    spec: AttentionSpec
    sinks: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        """Called once per layer when the model is built. ``num_heads`` and ``num_kv_heads`` are
        this tensor-parallel rank's query and KV heads, ``head_size`` the size of one head,
        ``scale`` the factor of ``q . k`` (``head_size ** -0.5``)."""
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.spec = AttentionSpec(num_heads, num_kv_heads, head_size, scale)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, v_head_size]
        kv_cache: torch.Tensor,  # the shape get_kv_cache_shape returned
        attn_metadata: Any,  # what build_metadata returned for this step
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_size]
        """One layer of one step: write the step's keys and values into the cache, then attend.

        ``query`` is ``[num_tokens, num_heads, head_size]``; ``key`` and ``value`` are
        ``[num_tokens, num_kv_heads, head_size]`` (after rotary embedding), in the model's dtype
        on the engine's device, possibly non-contiguous. Rows past the metadata's
        ``num_actual_tokens`` are padding: none of them is written to the cache. ``kv_cache`` is
        this layer's cache (the shape ``get_kv_cache_shape`` returned, zero when allocated,
        kept across steps); token ``t`` goes to slot ``slot_mapping[t]``. ``attn_metadata`` is
        what ``build_metadata`` (or, in a CUDA graph, ``build_graph_metadata``) returned for
        the step. Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``; which keys
        a query sees, and how its logits are formed, is ``self.spec`` (plain causal: a query
        token at position ``p`` sees its request's keys at positions ``0..p``). ``value`` and
        the output have ``spec.v_head_size`` per head.

        Returns a new ``[num_tokens, num_heads, v_head_size]`` tensor, dtype and device of
        ``query``; rows past ``num_actual_tokens`` are never read."""

    def attends_from_inputs(self, kv_cache: torch.Tensor, attn_metadata: Any) -> bool:
        """Called by the layer before a step whose keys and values no later step reads (a step
        of pooling prompts computed whole, whose blocks the prefix cache does not keep), with
        this layer's ``kv_cache`` and the step's ``attn_metadata``. Returns whether ``forward``
        of this step attends over the ``key`` and ``value`` it is given alone, reading nothing
        of the cache (the step's own rows included). Asked only of a backend that says
        ``accepts_model_stored_kv``: where true, the layer skips the cache write (it runs
        ``forward`` under :func:`kv_stored_by_model` with nothing stored), and the step's slots
        keep whatever they held. Default: false (the forward reads the cache; the write
        stays)."""
        return False


class AttentionBackend(ABC):
    """A family of attention kernels. Subclasses are classes, not instances: the runner calls
    the class methods, and builds one impl per layer."""

    name: ClassVar[str]
    #: Higher wins when ``attention.backend`` is ``auto`` and several support the model.
    priority: ClassVar[int] = 0
    #: Whether decode steps can be captured in a CUDA graph and replayed over fixed buffers.
    supports_cuda_graph: ClassVar[bool] = False
    #: Top-level modules the kernels import (``("flashinfer",)``): ``pagoda plugins`` names the
    #: missing ones when the backend cannot run on this machine.
    requires: ClassVar[tuple[str, ...]] = ()
    #: Whether the impl's ``forward``, called while :func:`model_stored_kv` is true, leaves the
    #: cache alone: the model's own kernel stored the step's keys and values (the ones
    #: ``forward`` gets) in their slots, in the default layout (``get_kv_cache_shape``'s
    #: default), as :func:`write_kv_cache` would, which then returns at once. A backend that
    #: writes only through ``write_kv_cache``, into that layout, may say true; one with a layout
    #: or a write of its own checks :func:`model_stored_kv` itself. The layer offers the cache
    #: to the model only then (:meth:`pagoda.attention.layer.Attention.kv_store_target`), and
    #: never for an FP8 cache.
    accepts_model_stored_kv: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        """Called at engine start to select a backend (by name or ``auto``), and by ``pagoda
        plugins``. ``device`` is the engine's ``torch.device``, ``dtype`` the model's, and
        ``head_size`` the model's head size. Returns whether this backend runs there."""

    @classmethod
    def configure(cls, config: AttentionConfig) -> None:
        """Called once per model runner, after this backend is selected and before any impl is
        built, with the ``attention`` section; a backend with settings of its own reads them
        here (``config.plugin_settings("my_plugin")``) into class attributes. Returns nothing.
        NOTE: the class is shared by every engine in the process: the last engine built wins.
        Default: nothing."""
        return None

    @classmethod
    def is_compiled(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        """Called at engine start, after ``supports``, with the same ``device``, ``dtype`` and
        ``head_size``. Returns whether the kernels this backend would run there are ready now
        (built ahead of time, or in a compile cache), so that the first step does not wait for
        a just-in-time compile. ``auto`` passes over a backend that is not, for the best one
        that is, and starts ``compile_command`` in the background so that a later start finds
        it ready. It should answer for every kernel any kind of step loads
        (:mod:`pagoda.attention.warmup` runs each kind): one left out compiles inside the
        engine's start. Default: true (kernels that compile in seconds need not say)."""
        return True

    @classmethod
    def compile_command(
        cls, device: torch.device, dtype: torch.dtype, head_size: int
    ) -> list[str] | None:
        """Called at engine start when ``is_compiled`` is false for ``device``, ``dtype`` and
        ``head_size`` (as ``supports`` gets them). Returns the argv of a command that compiles
        those kernels into the backend's compile cache and exits 0 (after it,
        ``is_compiled`` is true), or None when there is nothing to run. The engine runs it in a
        child process at low priority: in the background when ``auto`` chose another backend,
        before the first step when this backend was named; the last lines it prints are
        logged when it succeeds, so it should say there what it built and how long each took.
        Default: None."""
        return None

    @classmethod
    def unsupported(cls, spec: AttentionSpec) -> str | None:
        """Called when a layer is built, with its ``spec`` (a rejected spec stops the build);
        by the selector at engine start, for each layer's spec it is given (``auto`` passes over
        a backend that lacks a feature a layer needs); by the conformance kit, per case.
        Returns None when this backend computes ``spec``, else the name of the first
        :meth:`AttentionSpec.features` entry it lacks. Default: plain causal attention only
        (what every backend did before specs existed)."""
        missing = spec.features()
        return missing[0] if missing else None

    @classmethod
    def supports_kv_cache_dtype(cls, dtype: torch.dtype) -> bool:
        """Called at engine start with the KV cache's ``dtype`` when ``cache.kv_cache_dtype`` is
        not ``auto`` (``torch.float8_e4m3fn`` for ``fp8``). Returns whether this backend stores and
        reads a cache of that dtype, with the impl's ``k_scale`` and ``v_scale``
        (``write_kv_cache`` stores one). Default: false (a cache in the model's dtype only)."""
        return False

    @classmethod
    def supports_block_size(cls, block_size: int) -> bool:
        """Called at engine start with ``cache.block_size`` as ``block_size``. Returns whether
        this backend reads a paged cache with blocks of that many tokens (default: any)."""
        return block_size >= 1

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Called once, when the cache is allocated: ``num_blocks`` blocks of ``block_size``
        tokens, ``num_kv_heads`` (this rank's) heads of ``head_size``. Returns the shape of one
        layer's cache tensor; the default, ``(2, num_blocks, block_size, num_kv_heads,
        head_size)``, holds keys at [0] and values at [1] (``write_kv_cache``'s layout)."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    @abstractmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        """Called once per layer when the model is built. Returns the :class:`AttentionImpl`
        subclass the layer instantiates."""

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> Any:
        """Called once per step, before the model's first layer (never per layer), and for the
        GPU's profiling pass. ``common`` is the step (:class:`CommonAttentionMetadata`); plan
        from its host copies to avoid a device sync. Returns what every layer's ``forward``
        receives as ``attn_metadata`` for this step (default: ``common`` itself)."""
        return common

    @classmethod
    def build_graph_metadata(cls, common: CommonAttentionMetadata) -> Any:
        """Called once per captured batch size, at decode CUDA graph capture (only when
        ``supports_cuda_graph``). ``common`` holds ``num_reqs`` requests of one token each, views
        the runner's persistent buffers, and has worst-case lengths (``max_seq_len`` and every
        ``seq_lens_cpu`` are the model's limit). Returns the metadata the graph's layers
        capture and every replay of that graph reuses (default: ``build_metadata(common)``)."""
        return cls.build_metadata(common)

    @classmethod
    def prepare_graph_replay(cls, metadata: Any, common: CommonAttentionMetadata) -> None:
        """Called before each replay of a decode CUDA graph, outside the graph: bring
        ``metadata`` (what ``build_graph_metadata`` returned for this batch size) up to this
        step, whose ``common`` is padded to the graph's batch size (padding rows have
        ``seq_len`` 1, block table ``[0, ...]`` and slot 0: they attend to one slot of block 0).
        Returns nothing. Default: nothing, for backends whose kernels read all they need from
        the persistent buffers."""
        return None

    @classmethod
    def graph_replans(cls, metadata: Any) -> bool:
        """Called once per captured graph, after its capture, with ``metadata``, what
        ``build_graph_metadata`` returned for it. Returns whether ``prepare_graph_replay`` must
        run before that graph's replays. A graph that needs no re-plan replays without the padded
        ``common`` being built, and verification graphs that need none may be launched before
        the step in flight is read (speculative decoding's launches ahead). Default: whether the
        backend overrides ``prepare_graph_replay``."""
        return (
            cls.prepare_graph_replay.__func__ is not AttentionBackend.prepare_graph_replay.__func__
        )


_model_stored_kv = False


def model_stored_kv() -> bool:
    """Whether the model stored the keys and values of the layer running now in its cache itself
    (see ``AttentionBackend.accepts_model_stored_kv``): its impl does not write them again."""
    return _model_stored_kv


@contextmanager
def kv_stored_by_model() -> Iterator[None]:
    """:func:`model_stored_kv` is true inside (the layer, around its impl's ``forward``)."""
    global _model_stored_kv
    prev, _model_stored_kv = _model_stored_kv, True
    try:
        yield
    finally:
        _model_stored_kv = prev


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the first ``num_tokens`` rows of ``key`` and ``value`` (``[num_tokens,
    num_kv_heads, head_size]``) in their slots ``slot_mapping[:num_tokens]`` of ``kv_cache``, a
    cache in the default layout (``[2, num_blocks, block_size, num_kv_heads, head_size]``).

    Keys or values narrower than the cache's heads (``value_head_size`` differs from
    ``head_size``) fill the leading part of each head. An FP8 cache stores ``fp8(key /
    k_scale)`` and ``fp8(value / v_scale)``, ``k_scale`` and ``v_scale`` being the impl's
    float32 ``[1]`` scales (see :class:`AttentionImpl`; None: 1.0).

    One Triton kernel where :func:`pagoda.ops.kv_write_fused` says it can (a GPU's default),
    else two ``index_copy_``. Returns the key cache and the value cache, ``[num_blocks,
    block_size, num_kv_heads, head_size]`` views of ``kv_cache``; nothing is written while
    :func:`model_stored_kv` says the model stored them."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if _model_stored_kv:
        return key_cache, value_cache
    if ops.kv_write_fused(key, value, kv_cache, k_scale, v_scale):
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops.triton_kv_write import write_kv_triton

        write_kv_triton(key, value, kv_cache, slot_mapping, num_tokens, k_scale, v_scale)
        return key_cache, value_cache
    # The torch code: an ``index_copy_`` for the keys and another for the values (the same
    # bytes as the kernel's).
    heads, size = key.shape[1], kv_cache.shape[-1]
    slots = slot_mapping[:num_tokens]
    fp8 = kv_cache.dtype == FP8_DTYPE
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        rows = cache.view(-1, heads, size)
        if src.shape[2] != size:
            rows = rows[..., : src.shape[2]]
        src = src[:num_tokens]
        if fp8:
            # NOTE: as bytes: index_copy_ has no FP8 kernel on a CPU.
            src = to_fp8(src, 1.0 if scale is None else scale).view(torch.uint8)
            rows = rows.view(torch.uint8)
        rows.index_copy_(0, slots, src)
    return key_cache, value_cache


def read_kv(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values gathered from the cache, in ``dtype``: FP8 ones dequantized with their
    ``scale`` (:func:`write_kv_cache`), others as they are (no copy when already ``dtype``)."""
    if cache.dtype != FP8_DTYPE:
        return cache.to(dtype)
    return from_fp8(cache, 1.0 if scale is None else scale, dtype)
