"""Qwen3's per-head RMSNorm of q and k and the rotary embedding of both, in one Triton kernel,
bit-identical to the separate kernels it replaces.

The separate path is :func:`pagoda.ops.rms_norm` on q's heads, the same on k's, then
:func:`pagoda.ops.rotary_embedding` in place on the two outputs: three launches a layer. On random
weights a one-bit difference anywhere in them is enough for greedy tokens to leave transformers'
at a gap wider than a near-tie, so this kernel keeps every bit of them:

- each head's sum of squares is the norm kernel's own (``triton_norm._inv_rms``) over a tile of
  whole heads of the same shape, with the same warps, so that it is taken in the same order;
- the two halves of each head are then normalised as the norm kernel normalises (the same
  products, rounded to the input's dtype and to the output's as it rounds them) and rotated in
  registers, each product rounded on its own as in the rotary kernel (``mul_rn``; the rotary
  kernel is compiled without fused multiply-adds): one read of q and k and one write of each.

(Until this layout the kernel wrote the normalised heads, and after a barrier read them back to
rotate them in place: on an H200 at 16,384 tokens of Qwen3-0.6B's heads it took 68 us where one
read and one write take about 42.)

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
from pagoda.ops.triton_norm import _inv_rms, launch_shape


@triton.jit
def _mul(a, b, EXACT: tl.constexpr):
    """``a * b`` rounded on its own: never fused into an add that follows."""
    if EXACT:
        return libdevice.mul_rn(a, b)
    return a * b


@triton.jit
def _norm_rotate_heads(src, stride_h, dst, heads, w1, w2, cols, col_ok, d, d_ok, n, half, eps,
                       cos, sin, ROWS: tl.constexpr, HEADS_PAD: tl.constexpr,
                       EXACT: tl.constexpr):  # fmt: skip
    """Normalise then rotate ``heads`` rows at ``src`` (head stride ``stride_h``) into the dense
    ``dst``, ``ROWS`` rows a tile: each row's sum of squares from the whole row, loaded as the
    norm kernel tiles it (the same reduction, so the same bits), then its two halves normalised,
    rounded as the norm kernel's output is, and rotated in registers (one write a head)."""
    for first in tl.static_range(0, HEADS_PAD, ROWS):
        h = first + tl.arange(0, ROWS)
        h_ok = h < heads
        row = src + h[:, None] * stride_h
        x = tl.load(row + cols[None, :], mask=h_ok[:, None] & col_ok[None, :])
        xf = x.to(tl.float32)
        inv = _inv_rms(xf, n, eps)
        mask = h_ok[:, None] & d_ok[None, :]
        x1 = tl.load(row + d[None, :], mask=mask).to(tl.float32)
        x2 = tl.load(row + half + d[None, :], mask=mask).to(tl.float32)
        # The rest of the norm's arithmetic (``triton_norm._normalize_rows``), then its output's
        # rounding to ``dst``.
        y1 = (w1 * (x1 * inv[:, None]).to(x.dtype).to(tl.float32)).to(dst.dtype.element_ty)
        y2 = (w2 * (x2 * inv[:, None]).to(x.dtype).to(tl.float32)).to(dst.dtype.element_ty)
        y1 = y1.to(tl.float32)
        y2 = y2.to(tl.float32)
        out1 = _mul(y1, cos, EXACT) - _mul(y2, sin, EXACT)
        out2 = _mul(y2, cos, EXACT) + _mul(y1, sin, EXACT)
        p1 = dst + h[:, None] * n + d[None, :]
        tl.store(p1, out1.to(dst.dtype.element_ty), mask=mask)
        tl.store(p1 + half, out2.to(dst.dtype.element_ty), mask=mask)


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
    BLOCK_D: tl.constexpr,
    EXACT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n
    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < half
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d_ok)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + d, mask=d_ok)[None, :]
    wq1 = tl.load(wq_ptr + d, mask=d_ok).to(tl.float32)[None, :]
    wq2 = tl.load(wq_ptr + half + d, mask=d_ok).to(tl.float32)[None, :]
    _norm_rotate_heads(q_ptr + t * stride_qt, stride_qh, q_out_ptr + t * q_heads * n, q_heads,
                       wq1, wq2, cols, col_ok, d, d_ok, n, half, eps, cos, sin, ROWS, Q_PAD,
                       EXACT)  # fmt: skip
    wk1 = tl.load(wk_ptr + d, mask=d_ok).to(tl.float32)[None, :]
    wk2 = tl.load(wk_ptr + half + d, mask=d_ok).to(tl.float32)[None, :]
    _norm_rotate_heads(k_ptr + t * stride_kt, stride_kh, k_out_ptr + t * k_heads * n, k_heads,
                       wk1, wk2, cols, col_ok, d, d_ok, n, half, eps, cos, sin, ROWS, K_PAD,
                       EXACT)  # fmt: skip


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
        BLOCK_D=triton.next_power_of_2(half),
        # NOTE: mul_rn is the device's; the interpreter's products are never fused anyway.
        EXACT=os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=warps,
    )
    return q_out, k_out
