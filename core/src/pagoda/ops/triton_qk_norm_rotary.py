"""Qwen3's per-head RMSNorm of q and k and the rotary embedding of both, in one Triton kernel.

The same arithmetic as :func:`pagoda.ops.rms_norm` on each head of q and of k followed by
:func:`pagoda.ops.rotary_embedding`, with the result of the norm rounded to the model's dtype
before the rotation as the two kernels round it between them: one launch a layer where there
were three (q norm, k norm, rotation), the normalised q and k written once, already rotated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rotate_heads(
    src,
    stride_h,
    dst,
    heads,
    w_ptr,
    cos,
    sin,
    d,
    d_ok,
    half,
    eps,
    BLOCK_H: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None] & d_ok[None, :]
    p = src + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(p, mask=mask, other=0.0)
    x2 = tl.load(p + half, mask=mask, other=0.0)
    dtype = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    inv = tl.math.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * half) + eps)
    w1 = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + half + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    # Rounded where the separate kernels store: the norm's value, then the weighted output.
    n1 = (w1 * (f1 * inv[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    n2 = (w2 * (f2 * inv[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o = dst + h[:, None] * (2 * half) + d[None, :]
    tl.store(o, (n1 * cos - n2 * sin).to(dtype), mask=mask)
    tl.store(o + half, (n2 * cos + n1 * sin).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    wq_ptr,
    wk_ptr,
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
    eps,
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
    q_dst = q_out_ptr + t * q_heads * 2 * half
    k_dst = k_out_ptr + t * k_heads * 2 * half
    _norm_rotate_heads(
        q_ptr + t * stride_qt, stride_qh, q_dst, q_heads, wq_ptr, cos, sin, d, d_ok, half, eps,
        BLOCK_HQ,
    )  # fmt: skip
    _norm_rotate_heads(
        k_ptr + t * stride_kt, stride_kh, k_dst, k_heads, wk_ptr, cos, sin, d, d_ok, half, eps,
        BLOCK_HK,
    )  # fmt: skip


def qk_norm_rotary_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New dense q [tokens, heads, dim] and k [tokens, kv_heads, dim]: each head normalised with
    its weight (``q_weight`` or ``k_weight``, [dim]) then rotated at ``positions``; ``q`` and ``k``
    may be strided views (unit stride in the last dimension) and are left as they were."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"qk_norm_rotary takes q [tokens, heads, dim] and k [tokens, kv_heads, dim], got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    dim = q.shape[-1]
    half = dim // 2
    if cos.shape[-1] != half or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError(f"cos/sin tables must be [max_position, {half}] with the same layout")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("qk_norm_rotary needs q and k with unit stride in the last dimension")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0] > 0:
        _qk_norm_rotary_kernel[(q.shape[0],)](
            positions,
            q,
            k,
            q_out,
            k_out,
            q_weight,
            k_weight,
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
            eps,
            BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_D=triton.next_power_of_2(half),
            num_warps=4,
            enable_fp_fusion=False,
        )
    return q_out, k_out
