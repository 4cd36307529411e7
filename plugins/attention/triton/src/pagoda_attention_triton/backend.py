"""The Triton attention backend: one kernel for mixed batches over the paged cache.

Besides plain causal attention it computes a layer's sliding window, logit soft-cap, sinks and
chunks, and bidirectional attention (encoders; with a window or chunks too)
(:class:`~pagoda.attention.spec.AttentionSpec`), in every kernel path: each is a compile-time
flag of the kernels, so a plain layer runs the same code as before they existed. So is an FP8
KV cache (``cache.kv_cache_dtype: fp8``): the cache write quantizes with the layer's scales, and
the attention kernels read FP8 keys and values, their scales folded into the logits' scale and
the output.

A step of new prompts only (no request has cached context) of a plain layer, causal or
bidirectional, attends over the step's own keys and values instead of the cache
(:mod:`~pagoda_attention_triton.ragged_prefill`, a flash-attention forward); the setting
``plugins.triton.ragged_prefill: false`` (``PAGODA_PLUGINS__TRITON__RAGGED_PREFILL=false``) keeps
such steps on the paged kernel."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from pagoda.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    CommonAttentionMetadata,
    model_stored_kv,
    write_kv_cache,
)
from pagoda.attention.spec import AttentionSpec
from pagoda.config import AttentionConfig

# Below this many keys per split of an eager step's context, or of a window (or chunk), splitting
# costs more than it gains.
_MIN_KEYS_PER_SPLIT = 512
# A graph's context is split while its slices would hold this many keys (a tile) at the length it
# was captured at: the kernel sizes each program's slice from the keys it reads, so a graph
# captured at a long context still splits a short one evenly.
_MIN_CONTEXT_KEYS_PER_SPLIT = 64
# The most slices a step splits a context in (the split merge reads this many partials, masked).
MAX_SPLITS = 32
# Steps of up to this many queries a request (decode, verification of up to 15 drafts) split.
_SPLIT_MAX_QUERY = 16


def _interpreting() -> bool:
    # NOTE: the interpreter is for testing the kernels on a CPU; it must be asked for by name as
    # well, or `attention.backend: auto` would pick a backend thousands of times slower.
    return (
        os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("PAGODA_TRITON_ON_CPU") == "1"
    )


@cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# The spec's features the kernels compute; the other (a value head size of its own) they do not.
_FEATURES = frozenset({"causal", "sliding_window", "logit_softcap", "sinks", "chunk_size"})

# Decode steps of at least this many requests take their programs longest context first: with
# several waves of programs a multiprocessor, the last wave is then the shortest work.
_ORDER_MIN_REQS = 16


@dataclass
class TritonMetadata:
    common: CommonAttentionMetadata
    num_splits: int
    # The requests by descending context (device, int32), or None: the kernel's `order`.
    order: torch.Tensor | None = None
    # New prompts only: every request's context is its own query tokens (`_fresh`).
    fresh: bool = False


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    requires = ("triton",)
    priority = 50
    # (its forward skips its own write of keys and values the model stored: see below)
    accepts_model_stored_kv = True
    # Launch parameters depend only on the batch size and worst-case length the runner captures
    # with; lengths and block tables are read from device buffers at replay.
    supports_cuda_graph = True
    # Steps of new prompts only attend over their own keys (`plugins.triton.ragged_prefill`).
    ragged_prefill = True
    # FP8 caches store value pages transposed (`plugins.triton.fp8_transposed_values`).
    fp8_transposed_values = True

    @classmethod
    def configure(cls, config: AttentionConfig) -> None:
        settings = config.plugin_settings("triton")
        cls.ragged_prefill = settings.ragged_prefill
        cls.fp8_transposed_values = settings.fp8_transposed_values

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        on_device = device.type == "cuda" or (device.type == "cpu" and _interpreting())
        return (
            on_device
            and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and (8 <= head_size <= 256)
        )

    @classmethod
    def unsupported(cls, spec: AttentionSpec) -> str | None:
        return next((f for f in spec.features() if f not in _FEATURES), None)

    @classmethod
    def supports_kv_cache_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype == torch.float8_e4m3fn

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return TritonAttentionImpl

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TritonMetadata:
        md = TritonMetadata(common, _choose_splits(common))
        md.fresh = cls.ragged_prefill and _fresh(common)
        if _ordered(common) and not md.fresh:
            md.order = _host_to_device(_order(common), common.block_table.device)
        return md

    @classmethod
    def build_graph_metadata(cls, common: CommonAttentionMetadata) -> TritonMetadata:
        # (captured at the longest context: slices down to a tile, which the kernel sizes from
        # each replay's own contexts)
        md = TritonMetadata(common, _choose_splits(common, _MIN_CONTEXT_KEYS_PER_SPLIT))
        if _ordered(common):
            # Persistent: the graph's kernels read it; each replay rewrites it.
            md.order = torch.arange(
                common.num_reqs, dtype=torch.int32, device=common.block_table.device
            )
        return md

    @classmethod
    def prepare_graph_replay(
        cls, metadata: TritonMetadata, common: CommonAttentionMetadata
    ) -> None:
        if metadata.order is not None:
            metadata.order.copy_(_pinned(_order(common)), non_blocking=True)

    @classmethod
    def graph_replans(cls, metadata: TritonMetadata) -> bool:
        # Only decode graphs that order their requests; verification graphs replay as captured
        # (and may be launched ahead of the step in flight).
        return metadata.order is not None


def _ordered(common: CommonAttentionMetadata) -> bool:
    return (
        common.max_query_len == 1
        and common.num_reqs >= _ORDER_MIN_REQS
        and common.block_table.device.type == "cuda"
        and len(common.seq_lens_cpu) >= common.num_reqs  # the order must cover every request
    )


def _fresh(common: CommonAttentionMetadata) -> bool:
    """Whether every request of the step is a new prompt: its context (``seq_len``) is its own
    query tokens, read from the host copies (no device sync)."""
    n = common.num_reqs
    qsl, seq_lens = common.query_start_loc_cpu, common.seq_lens_cpu
    if n == 0 or len(qsl) < n + 1 or len(seq_lens) < n:
        return False
    return bool(np.array_equal(np.diff(qsl[: n + 1]), seq_lens[:n]))


def _ragged(spec: AttentionSpec, kv_cache: torch.Tensor) -> bool:
    """Whether a fresh step of this layer takes the ragged kernel: plain attention (causal or
    not; no window, chunks, soft-cap or sinks), a cache in the model's dtype, not FP8 (an FP8
    one is read back as stored, so every read of a token sees the same values)."""
    return (
        spec.sliding_window is None
        and spec.chunk_size is None
        and spec.logit_softcap is None
        and not spec.sinks
        and kv_cache.dtype != torch.float8_e4m3fn
    )


def _order(common: CommonAttentionMetadata) -> np.ndarray:
    from pagoda_attention_triton.kernels import longest_first

    return longest_first(common.seq_lens_cpu[: common.num_reqs])


def _pinned(a: np.ndarray) -> torch.Tensor:
    # NOTE: page-locked so the copy does not make the host wait; the allocator keeps the block
    # until the copy has run.
    return torch.from_numpy(a).pin_memory()


def _host_to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return _pinned(a).to(device, non_blocking=True)


def _choose_splits(common: CommonAttentionMetadata, min_keys: int = _MIN_KEYS_PER_SPLIT) -> int:
    """Split long contexts for decode steps of too few (request, KV head) programs to keep every
    multiprocessor busy to the end: a program holds one multiprocessor, and with few programs a
    wave of long contexts finishes alone. Replayed from CUDA graphs on an H200 (Qwen3-0.6B's
    heads, contexts 200 - 1800, benchmarks/triton_decode_tuning.py --graphs), splitting in 4 was
    2.4 times as fast at batch 4 and 1.8 at 16, 1.3 in 2 at 32, 1.1 in 4 at 64, 1.03 in 2 at 128,
    and 0.99 in 2 at 256.

    Each slice keeps ``min_keys`` of the step's longest context: an eager step's, 512 (the rule
    measured above; an eager step also allocates its slices' partials and launches their merge
    on the host each layer, not timed against more slices); a graph's, a tile
    (``_MIN_CONTEXT_KEYS_PER_SPLIT``), since it is captured at ``max_model_len`` and the kernel
    cuts each replay's own contexts (``benchmarks/small_batch_attention.py``)."""
    # NOTE: verification steps (a few queries a request, speculative decoding) split too: at
    # batch 1, unsplit, a model of few KV heads ran one program per KV head over the whole
    # context (SmolLM2: 3 programs on 132 multiprocessors), in float32 with IEEE dots, while
    # its decode steps split; verification then cost several decode steps (issue 44).
    if common.max_query_len > _SPLIT_MAX_QUERY or common.block_table.device.type != "cuda":
        return 1
    programs = common.num_reqs * 8  # KV heads are not known here; 8 is typical and only a guide
    sms = _num_sms(common.block_table.device.index or 0)
    if _ordered(common) and programs >= 4 * sms:
        # Longest first, an unsplit launch already ends evenly: at batch 128 and 192
        # (contexts 160 - 1440) it took 103 and 155 us a layer against 113 and 162 in 2 splits.
        return 1
    # (a verification's program holds several queries a KV head: fewer of them fill the device)
    target = (8 if common.max_query_len == 1 else 4) * sms
    splits = 1
    while (
        splits < MAX_SPLITS
        and programs * splits < target
        and common.max_seq_len // (splits * 2) >= min_keys
    ):
        splits *= 2
    return splits


def _layer_splits(
    num_splits: int, max_seq_len: int, spec: AttentionSpec, max_query_len: int = 1
) -> int:
    """The step's splits for a layer: a window (or chunk) shorter than the contexts leaves fewer
    keys to a query, and the kernel splits those (in slices sized from the step's longest
    context), not the context; halve the splits until each slice holds ``_MIN_KEYS_PER_SPLIT``.
    Without one the step's splits stand: the kernel cuts each program's own keys.
    Fixed per layer for a given step (and graph: it reads the captured worst-case length).
    Splits are for decode and verification steps; a bidirectional layer splits decode steps
    only, where its query (its request's last token) sees what a causal one's does: a window's
    ``w`` keys, not ``2w - 1``."""
    if not spec.causal and max_query_len > 1:  # (its window's keys would be 2w - 1)
        return 1
    keys = max_seq_len
    for local in (spec.sliding_window, spec.chunk_size):
        if local is not None:
            keys = min(keys, local)
    if keys >= max_seq_len:  # (the context's own slices, which the kernel sizes)
        return num_splits
    while num_splits > 1 and keys // num_splits < _MIN_KEYS_PER_SPLIT:
        num_splits //= 2
    return num_splits


def _fused_write(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """The one-kernel cache write addresses the cache as one contiguous tensor, and key and value
    through their strides with unit stride in the head dimension."""
    return kv_cache.is_contiguous() and key.stride(-1) == 1 and value.stride(-1) == 1


class TritonAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads)
        # NOTE: the layout of an FP8 cache's value pages is the engine's whose layer this is,
        # fixed when the layer is built: a second engine in the process configuring the backend
        # otherwise must not change how this one's cache is written (its captured graphs read
        # the layout they were captured with).
        self.fp8_transposed_values = TritonAttentionBackend.fp8_transposed_values

    def attends_from_inputs(self, kv_cache: torch.Tensor, attn_metadata: Any) -> bool:
        # The ragged kernel's steps: over the keys and values as given.
        return attn_metadata.fresh and _ragged(self.spec, kv_cache)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonMetadata,
    ) -> torch.Tensor:
        from pagoda.ops.triton_kv_write import write_kv_triton
        from pagoda_attention_triton.kernels import paged_attention, transposed_values
        from pagoda_attention_triton.ragged_prefill import ragged_prefill_attention

        c = attn_metadata.common
        n = c.num_actual_tokens
        spec = self.spec
        if spec.sinks and self.sinks is None:
            raise ValueError("an attention spec with sinks needs impl.sinks, [num_heads]")
        # (only the one-kernel write stores value pages transposed)
        transposed = kv_cache.dtype == torch.float8_e4m3fn and self.fp8_transposed_values
        if transposed and not kv_cache.is_contiguous():
            raise ValueError("an FP8 cache with transposed value pages must be contiguous")
        if model_stored_kv():  # (never an FP8 cache: the layer offers one in the model's dtype)
            key_cache, value_cache = kv_cache[0], kv_cache[1]
        elif transposed or _fused_write(kv_cache, key, value):
            # (the core's one-kernel write; where write_kv_cache would take it anyway, this
            # path also runs it on the interpreter's CPU)
            write_kv_triton(
                key if key.stride(-1) == 1 else key.contiguous(),
                value if value.stride(-1) == 1 else value.contiguous(),
                kv_cache, c.slot_mapping, n, self.k_scale, self.v_scale,
                values_transposed=transposed,
            )  # fmt: skip
            key_cache = kv_cache[0]
            value_cache = transposed_values(kv_cache) if transposed else kv_cache[1]
        else:
            key_cache, value_cache = write_kv_cache(
                key, value, kv_cache, c.slot_mapping, n, self.k_scale, self.v_scale
            )
        out = torch.empty_like(query)
        if attn_metadata.fresh and _ragged(spec, kv_cache):
            # (the kernel reads keys and values with unit stride in the head dim)
            key = key if key.stride(-1) == 1 else key.contiguous()
            value = value if value.stride(-1) == 1 else value.contiguous()
            return ragged_prefill_attention(
                query, key, value, out, c.query_start_loc, c.num_reqs, n, self.scale, spec.causal
            )
        paged_attention(
            query,
            key_cache,
            value_cache,
            out,
            c.block_table,
            c.seq_lens,
            c.query_start_loc,
            c.num_reqs,
            n,
            c.max_query_len,
            c.max_seq_len,
            self.scale,
            _layer_splits(attn_metadata.num_splits, c.max_seq_len, spec, c.max_query_len),
            order=attn_metadata.order,
            sliding_window=spec.sliding_window,
            logit_softcap=spec.logit_softcap,
            sinks=self.sinks if spec.sinks else None,
            chunk_size=spec.chunk_size,
            causal=spec.causal,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return out
