"""Qwen3's per-head RMSNorm of q and k and the rotary embedding of both, in one Triton kernel,
bit-identical to the separate kernels it replaces.

The separate path is :func:`pagoda.ops.rms_norm` on q's heads, the same on k's, then
:func:`pagoda.ops.rotary_embedding` in place on the two outputs: three launches a layer. On random
weights a one-bit difference anywhere in them is enough for greedy tokens to leave transformers'
at a gap wider than a near-tie, so this kernel keeps every bit of them:

- the norm is the norm kernel's own arithmetic (``triton_norm._normalize_rows``) on tiles of the
  same shape, with the same warps and with fused multiply-adds allowed as there, so that each
  row's sum of squares is taken in the same order;
- the normalised heads are written to the outputs and, after a barrier, read back and rotated in
  place, as the rotary kernel does, each product rounded on its own (``mul_rn``; the rotary
  kernel is compiled without fused multiply-adds).

The norm kernel tiles ``2048 // head_dim`` rows (16 at head size 128) unless there are fewer rows
in all, when its tile, and with it the order of the sums, follows the row count: then the
separate kernels run (a one-token step of a model with fewer than 16 KV heads).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagoda.ops import triton_norm, triton_rotary
from pagoda.ops.triton_norm import _normalize_rows, launch_shape


@triton.jit
def _mul(a, b, EXACT: tl.constexpr):
    """``a * b`` rounded on its own: never fused into an add that follows."""
    if EXACT:
        return libdevice.mul_rn(a, b)
    return a * b


@triton.jit
def _norm_heads(src, stride_h, dst, heads, w, cols, col_ok, n, eps, ROWS: tl.constexpr,
                HEADS_PAD: tl.constexpr):  # fmt: skip
    """Normalise ``heads`` rows at ``src`` (head stride ``stride_h``) into the dense ``dst``,
    ``ROWS`` rows a tile, as the norm kernel tiles them."""
    for first in tl.static_range(0, HEADS_PAD, ROWS):
        h = first + tl.arange(0, ROWS)
        mask = (h < heads)[:, None] & col_ok[None, :]
        x = tl.load(src + h[:, None] * stride_h + cols[None, :], mask=mask)
        y = _normalize_rows(x, w, n, eps)
        tl.store(dst + h[:, None] * n + cols[None, :], y.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(base, heads, n, cos, sin, d, d_ok, half, BLOCK_H: tl.constexpr,
                  EXACT: tl.constexpr):  # fmt: skip
    """The rotary kernel's rotation, in place on ``heads`` dense rows of ``n`` at ``base``."""
    h = tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None] & d_ok[None, :]
    p1 = base + h[:, None] * n + d[None, :]
    x1 = tl.load(p1, mask=mask).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask).to(tl.float32)
    out1 = _mul(x1, cos, EXACT) - _mul(x2, sin, EXACT)
    out2 = _mul(x2, cos, EXACT) + _mul(x1, sin, EXACT)
    tl.store(p1, out1.to(base.dtype.element_ty), mask=mask)
    tl.store(p1 + half, out2.to(base.dtype.element_ty), mask=mask)


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
    n,
    half,
    eps,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EXACT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n
    q_dst = q_out_ptr + t * q_heads * n
    k_dst = k_out_ptr + t * k_heads * n
    wq = tl.load(wq_ptr + cols, mask=col_ok).to(tl.float32)
    _norm_heads(q_ptr + t * stride_qt, stride_qh, q_dst, q_heads, wq, cols, col_ok, n, eps, ROWS,
                Q_PAD)  # fmt: skip
    wk = tl.load(wk_ptr + cols, mask=col_ok).to(tl.float32)
    _norm_heads(k_ptr + t * stride_kt, stride_kh, k_dst, k_heads, wk, cols, col_ok, n, eps, ROWS,
                K_PAD)  # fmt: skip
    tl.debug_barrier()  # the normalised heads, written by every thread, read back by others

    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < half
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d_ok)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + d, mask=d_ok)[None, :]
    _rotate_heads(q_dst, q_heads, n, cos, sin, d, d_ok, half, BLOCK_HQ, EXACT)
    _rotate_heads(k_dst, k_heads, n, cos, sin, d, d_ok, half, BLOCK_HK, EXACT)


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
    may be strided views (unit stride in the last dimension) and are left as they were. The same
    bits as ``rms_norm_triton`` on each and ``rotary_embedding_triton`` on the results."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"qk_norm_rotary takes q [tokens, heads, dim] and k [tokens, kv_heads, dim], got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    tokens, q_heads, dim = q.shape
    k_heads = k.shape[1]
    half = dim // 2
    if cos.shape[-1] != half or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError(f"cos/sin tables must be [max_position, {half}] with the same layout")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("qk_norm_rotary needs q and k with unit stride in the last dimension")
    # The norm kernel's tile for all of q's rows and all of k's, and for a row count without end.
    full = launch_shape(dim, 1 << 30)
    if launch_shape(dim, tokens * q_heads) != full or launch_shape(dim, tokens * k_heads) != full:
        qn = triton_norm.rms_norm_triton(q, q_weight, eps)
        kn = triton_norm.rms_norm_triton(k, k_weight, eps)
        return triton_rotary.rotary_embedding_triton(positions, qn, kn, cos, sin)
    rows, block_n, warps = full
    # Dtypes as the norm kernel gives them (the weight's and the input's, promoted).
    q_out = torch.empty(
        q.shape, dtype=torch.promote_types(q_weight.dtype, q.dtype), device=q.device
    )
    k_out = torch.empty(
        k.shape, dtype=torch.promote_types(k_weight.dtype, k.dtype), device=k.device
    )
    _qk_norm_rotary_kernel[(tokens,)](
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
        q_heads,
        k_heads,
        dim,
        half,
        eps,
        ROWS=rows,
        BLOCK_N=block_n,
        Q_PAD=triton.cdiv(q_heads, rows) * rows,
        K_PAD=triton.cdiv(k_heads, rows) * rows,
        BLOCK_HQ=triton.next_power_of_2(q_heads),
        BLOCK_HK=triton.next_power_of_2(k_heads),
        BLOCK_D=triton.next_power_of_2(half),
        # NOTE: mul_rn is the device's; the interpreter's products are never fused anyway.
        EXACT=os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=warps,
    )
    return q_out, k_out
