"""Qwen3's per-head RMSNorm of q and k and the rotary embedding of both, in one Triton kernel,
bit-identical to the separate kernels it replaces.

The separate path is :func:`pagoda.ops.rms_norm` on q's heads, the same on k's, then
:func:`pagoda.ops.rotary_embedding` in place on the two outputs: three launches a layer. On random
weights a one-bit difference anywhere in them is enough for greedy tokens to leave transformers'
at a gap wider than a near-tie, so this kernel keeps every bit of them:

- each head's sum of squares is the norm kernel's own (``triton_norm._inv_rms``) over a tile of
  whole heads of the same shape, with the same warps (or fewer: see ``num_warps``), so that it is
  taken in the same order; which heads, of which tokens, share a tile does not matter (the norm
  kernel's tiles run across tokens too), as a row's sum never leaves its lanes;
- the two halves of each head are then normalised as the norm kernel normalises (the same
  products, rounded to the input's dtype and to the output's as it rounds them) and rotated in
  registers, each product rounded on its own as in the rotary kernel (``mul_rn``; the rotary
  kernel is compiled without fused multiply-adds): one read of q and k and one write of each.

(Until this layout the kernel wrote the normalised heads, and after a barrier read them back to
rotate them in place: on an H200 at 16,384 tokens of Qwen3-0.6B's heads it took 68 us where one
read and one write take about 42.)

Variants (keywords of :func:`qk_norm_rotary_triton`, all of them the same bits; compiled for
sm_90, the sum's tile has the norm kernel's layout, 8 columns a thread on 16 lanes a row, in each):
where the halves come from (loaded again, or exchanged across lanes from the row as loaded), how
many tokens a program takes (one, or several with their rows tiled one after another so that
8 KV heads of two tokens fill a tile of 16), and the warps.

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
from pagoda.ops.launch import JitLaunch
from pagoda.ops.triton_norm import _inv_rms, launch_shape


@triton.jit
def _mul(a, b, EXACT: tl.constexpr):
    """``a * b`` rounded on its own: never fused into an add that follows."""
    if EXACT:
        return libdevice.mul_rn(a, b)
    return a * b


@triton.jit
def _norm_rotate_heads(src, stride_t, stride_h, dst, heads, w_ptr, tok0, tokens, pos_ptr,
                       stride_pos, cos_ptr, sin_ptr, stride_cos, n, half, eps,
                       ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       HEADS_PAD: tl.constexpr, TOKENS: tl.constexpr, HALVES: tl.constexpr,
                       EXACT: tl.constexpr):  # fmt: skip
    """Normalise then rotate the ``TOKENS * heads`` rows of tokens ``tok0`` on (below ``tokens``)
    at ``src`` (token and head strides ``stride_t``, ``stride_h``) into the dense ``dst``, ``ROWS``
    rows a tile, a row after another as the norm kernel tiles them: each row's sum of squares from
    the whole row as loaded (the same reduction, so the same bits), then the row normalised,
    rounded as the norm kernel's output is, and rotated in registers (one write a head).

    ``HALVES`` says where the rotation's halves come from: 0 loads them again, 1 exchanges the
    two halves of the normalised row across lanes (``tl.flip``: bits moved, no arithmetic), 2 takes
    them apart with ``tl.reshape``/``tl.permute``/``tl.split`` and joins the outputs back; 1 and 2
    need ``n == BLOCK_N``."""
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n
    d = tl.arange(0, BLOCK_D)
    d_ok = d < half
    if HALVES == 1:
        w = tl.load(w_ptr + cols, mask=col_ok).to(tl.float32)[None, :]
        # cos and sin of each column's pair; sin negated where the partner is subtracted.
        trig = cols % half
        sign = tl.where(cols < half, -1.0, 1.0)[None, :]
    else:
        w1 = tl.load(w_ptr + d, mask=d_ok).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + d, mask=d_ok).to(tl.float32)[None, :]
    if TOKENS == 1:
        # One token's heads, its cos/sin row loaded once and broadcast to every row.
        pos = tl.load(pos_ptr + tok0 * stride_pos).to(tl.int64)
        if HALVES == 1:
            cos = tl.load(cos_ptr + pos * stride_cos + trig, mask=col_ok)[None, :]
            sin = tl.load(sin_ptr + pos * stride_cos + trig, mask=col_ok)[None, :] * sign
        else:
            cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d_ok)[None, :]
            sin = tl.load(sin_ptr + pos * stride_cos + d, mask=d_ok)[None, :]
    for first in tl.static_range(0, HEADS_PAD, ROWS):
        r = first + tl.arange(0, ROWS)
        if TOKENS == 1:
            h_ok = r < heads
            row = src + tok0 * stride_t + r[:, None] * stride_h
        else:
            # Rows of several tokens in a tile, as in the norm kernel: row r is (r // heads,
            # r % heads); each row's cos/sin is its own token's.
            t = tok0 + r // heads
            h_ok = (r < TOKENS * heads) & (t < tokens)
            row = src + (t * stride_t + (r % heads) * stride_h)[:, None]
            pos = tl.load(pos_ptr + t * stride_pos, mask=h_ok, other=0).to(tl.int64)[:, None]
            if HALVES == 1:
                cos = tl.load(cos_ptr + pos * stride_cos + trig[None, :])
                sin = tl.load(sin_ptr + pos * stride_cos + trig[None, :]) * sign
            else:
                cos = tl.load(cos_ptr + pos * stride_cos + d[None, :], mask=d_ok[None, :])
                sin = tl.load(sin_ptr + pos * stride_cos + d[None, :], mask=d_ok[None, :])
        x = tl.load(row + cols[None, :], mask=h_ok[:, None] & col_ok[None, :])
        xf = x.to(tl.float32)
        inv = _inv_rms(xf, n, eps)
        out_row = dst + (tok0 * heads + r)[:, None] * n
        if HALVES == 1:
            # The rest of the norm's arithmetic (``triton_norm._normalize_rows``), then its
            # output's rounding to ``dst``.
            y = (w * (xf * inv[:, None]).to(x.dtype).to(tl.float32)).to(dst.dtype.element_ty)
            y = y.to(tl.float32)
            # Each value's partner (the other half's value in its column), moved bit for bit.
            p = tl.reshape(tl.flip(tl.reshape(y, [ROWS, 2, BLOCK_N // 2]), 1), [ROWS, BLOCK_N])
            # First half y1 * cos + y2 * -sin: the bits of y1 * cos - y2 * sin; second half
            # y2 * cos + y1 * sin.
            out = _mul(y, cos, EXACT) + _mul(p, sin, EXACT)
            tl.store(out_row + cols[None, :], out.to(dst.dtype.element_ty),
                     mask=h_ok[:, None] & col_ok[None, :])  # fmt: skip
        else:
            mask = h_ok[:, None] & d_ok[None, :]
            if HALVES == 2:
                x1, x2 = tl.split(tl.permute(tl.reshape(xf, [ROWS, 2, BLOCK_D]), (0, 2, 1)))
            else:
                x1 = tl.load(row + d[None, :], mask=mask).to(tl.float32)
                x2 = tl.load(row + half + d[None, :], mask=mask).to(tl.float32)
            y1 = (w1 * (x1 * inv[:, None]).to(x.dtype).to(tl.float32)).to(dst.dtype.element_ty)
            y2 = (w2 * (x2 * inv[:, None]).to(x.dtype).to(tl.float32)).to(dst.dtype.element_ty)
            y1 = y1.to(tl.float32)
            y2 = y2.to(tl.float32)
            out1 = _mul(y1, cos, EXACT) - _mul(y2, sin, EXACT)
            out2 = _mul(y2, cos, EXACT) + _mul(y1, sin, EXACT)
            if HALVES == 2:
                out = tl.reshape(tl.permute(tl.join(out1, out2), (0, 2, 1)), [ROWS, BLOCK_N])
                tl.store(out_row + cols[None, :], out.to(dst.dtype.element_ty),
                         mask=h_ok[:, None] & col_ok[None, :])  # fmt: skip
            else:
                p1 = out_row + d[None, :]
                tl.store(p1, out1.to(dst.dtype.element_ty), mask=mask)
                tl.store(p1 + half, out2.to(dst.dtype.element_ty), mask=mask)


# NOTE: the token count changes with every step: one variant for all of them.
@triton.jit(do_not_specialize=["tokens"])
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
    tokens,
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
    TOKENS: tl.constexpr,
    HALVES: tl.constexpr,
    EXACT: tl.constexpr,
):
    tok0 = tl.program_id(0).to(tl.int64) * TOKENS
    _norm_rotate_heads(q_ptr, stride_qt, stride_qh, q_out_ptr, q_heads, wq_ptr, tok0, tokens,
                       pos_ptr, stride_pos, cos_ptr, sin_ptr, stride_cos, n, half, eps, ROWS,
                       BLOCK_N, BLOCK_D, Q_PAD, TOKENS, HALVES, EXACT)  # fmt: skip
    _norm_rotate_heads(k_ptr, stride_kt, stride_kh, k_out_ptr, k_heads, wk_ptr, tok0, tokens,
                       pos_ptr, stride_pos, cos_ptr, sin_ptr, stride_cos, n, half, eps, ROWS,
                       BLOCK_N, BLOCK_D, K_PAD, TOKENS, HALVES, EXACT)  # fmt: skip


_qk_norm_rotary_kernel_launch = JitLaunch(_qk_norm_rotary_kernel)

# Where the rotation's halves come from (``_norm_rotate_heads``'s ``HALVES``).
HALVES = {"reload": 0, "swap": 1, "split": 2}


def halves_used(dim: int, halves: str) -> str:
    """The ``halves`` variant that runs for heads of ``dim``: "swap" and "split" take a row apart
    in registers, which needs a row without padding (``dim`` a power of two); else "reload"."""
    if halves not in HALVES:
        raise ValueError(f"halves must be one of {sorted(HALVES)}, got {halves!r}")
    return halves if dim == triton.next_power_of_2(dim) else "reload"


def qk_norm_rotary_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    halves: str = "swap",
    tokens_per_program: int = 2,
    num_warps: int | None = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New dense q [tokens, heads, dim] and k [tokens, kv_heads, dim]: each head normalised with
    its weight (``q_weight`` or ``k_weight``, [dim]) then rotated at ``positions``; ``q`` and ``k``
    may be strided views (unit stride in the last dimension) and are left as they were. The same
    bits as ``rms_norm_triton`` on each and ``rotary_embedding_triton`` on the results.

    Variants, the same bits in each (``benchmarks/qk_norm_rotary.py`` times them). The defaults
    (swap, 2 tokens a program, 4 warps) were the fastest on an H200 at Qwen3-0.6B's heads, bf16:
    118 us at 32,768 tokens against 130 for reload, 1 token, 8 warps (the kernel before them)
    and 216 for the separate kernels; 68 against 107 at 16,384
    (``benchmarks/results/qk-norm-rotary-h200-321f079.json``).

    - ``halves``: "reload" loads each head's two halves again after its sum of squares; "swap"
      normalises the whole row as loaded and moves each value's partner across lanes; "split"
      takes the loaded row apart with reshape/permute/split. "swap" and "split" fall back to
      "reload" where ``dim`` is not a power of two (:func:`halves_used`).
    - ``tokens_per_program``: a program normalises the rows of that many tokens, tiled a row after
      another as the norm kernel tiles them (2 tokens fill a tile of 16 rows with 8 KV heads).
    - ``num_warps``: the norm kernel's (``launch_shape``: 8 at every head size) when None, and at
      most that. Fewer keep each row's columns on the same registers and lanes (warps differ only
      in the rows they hold), so its sum in the same order; more are refused: at 16 warps Triton
      lays a 16 x 128 tile out 4 columns a thread instead of 8, another order of the sum.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"qk_norm_rotary takes q [tokens, heads, dim] and k [tokens, kv_heads, dim], got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    tokens, q_heads, dim = q.shape
    k_heads = k.shape[1]
    half = dim // 2
    halves = halves_used(dim, halves)
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
    if tokens_per_program < 1:
        raise ValueError(f"tokens_per_program must be at least 1, got {tokens_per_program}")
    if num_warps is not None and (num_warps > warps or num_warps & (num_warps - 1)):
        raise ValueError(f"num_warps must be a power of two up to the norm kernel's {warps}")
    # Dtypes as the norm kernel gives them (the weight's and the input's, promoted).
    q_out = torch.empty(
        q.shape, dtype=torch.promote_types(q_weight.dtype, q.dtype), device=q.device
    )
    k_out = torch.empty(
        k.shape, dtype=torch.promote_types(k_weight.dtype, k.dtype), device=k.device
    )
    per = tokens_per_program
    _qk_norm_rotary_kernel_launch(
        (triton.cdiv(tokens, per),),
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
        tokens,
        q_heads,
        k_heads,
        dim,
        half,
        eps,
        ROWS=rows,
        BLOCK_N=block_n,
        Q_PAD=triton.cdiv(per * q_heads, rows) * rows,
        K_PAD=triton.cdiv(per * k_heads, rows) * rows,
        BLOCK_D=triton.next_power_of_2(half),
        TOKENS=per,
        HALVES=HALVES[halves],
        # NOTE: mul_rn is the device's; the interpreter's products are never fused anyway.
        EXACT=os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=warps if num_warps is None else num_warps,
    )
    return q_out, k_out
