"""Punica's batched LoRA kernels in Triton (:mod:`pagoda.ops.lora` says what they compute).

SGMV (segments: a step's prompt chunks) tiles each segment's tokens and multiplies them with
their adapter's matrix by ``tl.dot``; BGMV (rows: decode steps, CUDA graphs) reduces one token
against its adapter's matrix. A program whose segment or row has no adapter (slot -1) returns at
once: base-model rows cost nothing. Accumulation is float32; float32 inputs multiply in IEEE
precision (not TF32), so they match the torch reference to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _precision(dtype: torch.dtype) -> str | None:
    """float32 products in IEEE precision (not TF32); 16-bit inputs: the default."""
    return "ieee" if dtype == torch.float32 else None


# ---- SGMV: segments ------------------------------------------------------------------------------


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, y_ptr, seg_starts, seg_slots, K, R,
    sx0, sx1, sa0, sa1, sa2, sy0,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    slot = tl.load(seg_slots + seg).to(tl.int64)
    start = tl.load(seg_starts + seg)
    end = tl.load(seg_starts + seg + 1)
    m0 = start + tl.program_id(1) * BLOCK_M
    if (slot < 0) | (m0 >= end):
        return
    rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(
            x_ptr + rows[:, None] * sx0 + kk[None, :] * sx1,
            mask=(rows[:, None] < end) & (kk[None, :] < K),
            other=0.0,
        )
        a = tl.load(
            a_ptr + slot * sa0 + cols[None, :] * sa1 + kk[:, None] * sa2,
            mask=(cols[None, :] < R) & (kk[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(x, a, input_precision=PRECISION)
    tl.store(
        y_ptr + rows[:, None] * sy0 + cols[None, :],
        acc,
        mask=(rows[:, None] < end) & (cols[None, :] < R),
    )


@triton.jit
def _sgmv_expand_kernel(
    y_ptr, b_ptr, out_ptr, seg_starts, seg_slots, N, R, y_off,
    sy0, sb0, sb1, sb2, so0, so1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    slot = tl.load(seg_slots + seg).to(tl.int64)
    start = tl.load(seg_starts + seg)
    end = tl.load(seg_starts + seg + 1)
    m0 = start + tl.program_id(1) * BLOCK_M
    if (slot < 0) | (m0 >= end):
        return
    rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    row_ok = rows[:, None] < end
    y = tl.load(
        y_ptr + rows[:, None] * sy0 + y_off + rs[None, :],
        mask=row_ok & (rs[None, :] < R),
        other=0.0,
    )
    b = tl.load(
        b_ptr + slot * sb0 + cols[None, :] * sb1 + rs[:, None] * sb2,
        mask=(cols[None, :] < N) & (rs[:, None] < R),
        other=0.0,
    )
    delta = tl.dot(y.to(b.dtype), b, input_precision=PRECISION)
    mask = row_ok & (cols[None, :] < N)
    ptrs = out_ptr + rows[:, None] * so0 + cols[None, :] * so1
    old = tl.load(ptrs, mask=mask).to(tl.float32)
    tl.store(ptrs, (old + delta).to(out_ptr.dtype.element_ty), mask=mask)


def _segment_grid(n_seg: int, max_seg_len: int, block_m: int, n: int, block_n: int) -> tuple:
    return (n_seg, triton.cdiv(max(max_seg_len, 1), block_m), triton.cdiv(n, block_n))


def _block_m(max_seg_len: int) -> int:
    return 16 if max_seg_len <= 16 else 32 if max_seg_len <= 32 else 64


def sgmv_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    tokens, k = x.shape
    r = a.shape[1]
    # NOTE: rows without an adapter are left unwritten: no expand reads them.
    y = torch.empty(tokens, r, dtype=torch.float32, device=x.device)
    n_seg = seg_slots.shape[0]
    if tokens == 0 or n_seg == 0:
        return y
    bm, bn, bk = _block_m(max_seg_len), max(16, min(64, triton.next_power_of_2(r))), 64
    _sgmv_shrink_kernel[_segment_grid(n_seg, max_seg_len, bm, r, bn)](
        x, a, y, seg_starts, seg_slots, k, r,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=_precision(x.dtype), num_warps=4,
    )  # fmt: skip
    return y


def sgmv_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    out: torch.Tensor,
    offset: int = 0,
) -> None:
    n, r = b.shape[1], b.shape[2]
    n_seg = seg_slots.shape[0]
    if y.shape[0] == 0 or n_seg == 0:
        return
    bm, bn, br = _block_m(max_seg_len), 64, max(16, triton.next_power_of_2(r))
    _sgmv_expand_kernel[_segment_grid(n_seg, max_seg_len, bm, n, bn)](
        y, b, out, seg_starts, seg_slots, n, r, offset,
        y.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br, PRECISION=_precision(b.dtype), num_warps=4,
    )  # fmt: skip


# ---- BGMV: one slot a row ------------------------------------------------------------------------


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, y_ptr, token_slots, K, R,
    sx0, sx1, sa0, sa1, sa2, sy0,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots + t).to(tl.int64)
    if slot < 0:
        return
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + t * sx0 + kk * sx1, mask=kk < K, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * sa0 + rs[:, None] * sa1 + kk[None, :] * sa2,
            mask=(rs[:, None] < R) & (kk[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(y_ptr + t * sy0 + rs, acc, mask=rs < R)


@triton.jit
def _bgmv_expand_kernel(
    y_ptr, b_ptr, out_ptr, token_slots, N, R, B1, B2,
    sy0, sb0, sb1, sb2, so0, so1,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots + t).to(tl.int64)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # The slice each column is in (q | k | v): it reads that slice's R columns of y.
    part = (cols >= B1).to(tl.int32) + (cols >= B2).to(tl.int32)
    rs = tl.arange(0, BLOCK_R)
    mask = (cols[:, None] < N) & (rs[None, :] < R)
    y = tl.load(y_ptr + t * sy0 + part[:, None] * R + rs[None, :], mask=mask, other=0.0)
    b = tl.load(
        b_ptr + slot * sb0 + cols[:, None] * sb1 + rs[None, :] * sb2, mask=mask, other=0.0
    ).to(tl.float32)
    delta = tl.sum(b * y, axis=1)
    ptrs = out_ptr + t * so0 + cols * so1
    old = tl.load(ptrs, mask=cols < N).to(tl.float32)
    tl.store(ptrs, (old + delta).to(out_ptr.dtype.element_ty), mask=cols < N)


def bgmv_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    tokens, k = x.shape
    r = a.shape[1]
    y = torch.empty(tokens, r, dtype=torch.float32, device=x.device)  # (as sgmv_shrink)
    if tokens == 0:
        return y
    # NOTE: a few ranks a program and long strides of K (Punica's BGMV: a block per output):
    # a decode step's few rows still fill the device, each program reducing K in few steps.
    br, bk = 4, 512
    _bgmv_shrink_kernel[(tokens, triton.cdiv(r, br))](
        x, a, y, token_slots, k, r,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), y.stride(0),
        BLOCK_R=br, BLOCK_K=bk, num_warps=4,
    )  # fmt: skip
    return y


def bgmv_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    bounds: tuple[int, ...] = (),
) -> None:
    """Every slice of :func:`pagoda.ops.lora.expand` in one launch (at most three)."""
    n, r = b.shape[1], b.shape[2]
    if y.shape[0] == 0:
        return
    if len(bounds) > 2:
        raise ValueError(f"bgmv_expand takes at most three slices, got bounds {bounds}")
    b1, b2 = (*bounds, n, n)[:2]
    bn = 128
    _bgmv_expand_kernel[(y.shape[0], triton.cdiv(n, bn))](
        y, b, out, token_slots, n, r, b1, b2,
        y.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BLOCK_N=bn, BLOCK_R=triton.next_power_of_2(r), num_warps=4,
    )  # fmt: skip
