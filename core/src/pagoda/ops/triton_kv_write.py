"""The KV cache write in Triton: each token's key and value to its slot in one launch.

:func:`pagoda.attention.backend.write_kv_cache`'s torch code takes an ``index_copy_`` for the
keys and another for the values, and each copies a strided source (the split of a qkv
projection) through a gather of its own: on an H200 the two took 25 ms of an embedding call whose
one-kernel write takes 7. Here a program a token reads its key and value rows through their
strides and stores them in the cache (``[2, num_blocks, block_size, num_kv_heads, head_size]``,
contiguous), as FP8 (``fp8(x / scale)``, clamped to the format's range) when the cache is.

``values_transposed`` stores each value page as ``[num_kv_heads, head_size, block_size]`` in the
same bytes (a backend's layout for FP8 decode; the Triton attention plugin's
``transposed_values`` reads it). A slot below zero (a padded token) writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.ops.launch import JitLaunch


@triton.jit
def _write_kv(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    k_scale_ptr,
    v_scale_ptr,
    heads,
    head_dim,
    value_offset,
    page,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    VALUES_TRANSPOSED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padded token writes nowhere
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < heads)[:, None] & (d < head_dim)[None, :]
    dst = cache_ptr + slot * heads * head_dim + h[:, None] * head_dim + d[None, :]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if FP8:  # fp8(x / scale), clamped to the format's range (a cast past it gives NaN)
        k = tl.clamp(k.to(tl.float32) / tl.load(k_scale_ptr), -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / tl.load(v_scale_ptr), -448.0, 448.0)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    if VALUES_TRANSPOSED:  # the page as [head, dim, token] (`transposed_values`)
        block, pos = slot // page, slot % page
        dst = (
            cache_ptr
            + block * heads * head_dim * page
            + h[:, None] * head_dim * page
            + d[None, :] * page
            + pos
        )
    tl.store(dst + value_offset, v.to(cache_ptr.dtype.element_ty), mask=mask)


_write_kv_launch = JitLaunch(_write_kv)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    values_transposed: bool = False,
) -> None:
    """Store the first ``num_tokens`` rows of ``key`` and ``value`` (``[tokens, num_kv_heads,
    head_size]``, unit stride in the head dimension) in their slots of ``kv_cache`` (contiguous),
    an FP8 cache with its float32 ``[1]`` scales (on the device)."""
    heads, size = key.shape[1], key.shape[2]
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache is written with its k_scale and v_scale")
    if not num_tokens:
        return
    _write_kv_launch(
        (num_tokens,),
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_scale if fp8 else slot_mapping,  # (unread without FP8)
        v_scale if fp8 else slot_mapping,
        heads,
        size,
        kv_cache.stride(0),
        kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(size),
        FP8=fp8,
        VALUES_TRANSPOSED=values_transposed,
        num_warps=4,
    )
