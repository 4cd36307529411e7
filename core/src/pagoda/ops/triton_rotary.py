"""Neox-style rotary embedding of q and k in Triton, in place: one program per token reads the
token's position and its cos/sin row once, then rotates every q and k head.

q and k may be strided views (the split of a qkv projection): rows and heads are addressed through
their strides; the last dimension must have unit stride. Arithmetic follows
:func:`pagoda.ops.reference.rotary_embedding` (float32, no fused multiply-add, rounded back once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.ops.launch import JitLaunch


@triton.jit
def _rotate_heads(base, stride_h, heads, cos, sin, d, d_ok, half, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None] & d_ok[None, :]
    p1 = base + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(p1, mask=mask).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(base.dtype.element_ty), mask=mask)
    tl.store(p1 + half, (x2 * cos + x1 * sin).to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_pos,
    stride_cos,
    q_heads,
    k_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < half
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d_ok)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + d, mask=d_ok)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, q_heads, cos, sin, d, d_ok, half, BLOCK_HQ)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, k_heads, cos, sin, d, d_ok, half, BLOCK_HK)


_rotary_kernel_launch = JitLaunch(_rotary_kernel)


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.dim() != 3 or k.dim() != 3 or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"rotary_embedding takes q [tokens, heads, dim] and k [tokens, kv_heads, dim], got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    half = q.shape[-1] // 2
    if cos.shape[-1] != half or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError(f"cos/sin tables must be [max_position, {half}] with the same layout")
    # NOTE: in place, so a copy would lose the result: only tensors the kernel can address directly.
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_embedding needs q and k with unit stride in the last dimension")
    if q.shape[0] > 0:
        _rotary_kernel_launch(
            (q.shape[0],),
            positions,
            q,
            k,
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            positions.stride(0),
            cos.stride(0),
            q.shape[1],
            k.shape[1],
            half,
            BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_D=triton.next_power_of_2(half),
            num_warps=4,
            enable_fp_fusion=False,
        )
    return q, k
