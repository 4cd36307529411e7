"""Punica's batched LoRA kernels in Triton (:mod:`pagoda.ops.lora` says what they compute).

SGMV (segments: a step's prompt chunks) tiles each segment's tokens and multiplies them with
their adapter's matrix by ``tl.dot``; BGMV (rows: decode steps, CUDA graphs) reduces one token
against its adapter's matrix. A program whose segment or row has no adapter (slot -1) returns at
once: base-model rows cost nothing. Accumulation is float32; float32 inputs multiply in IEEE
precision (not TF32), so they match the torch reference to rounding.

A decode step's rows can instead run shrink and expand fused in one launch a projection
(``fused_rows``, ``fused_slots``; :mod:`pagoda.ops.lora` says which runs).
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
    sy0, sy_slot, sb0, sb1, sb2, so0, so1,
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
    y_row = y_ptr + t * sy0 + slot * sy_slot  # (sy_slot: each slot's own columns of y)
    y = tl.load(y_row + part[:, None] * R + rs[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(
        b_ptr + slot * sb0 + cols[:, None] * sb1 + rs[None, :] * sb2, mask=mask, other=0.0
    ).to(tl.float32)
    delta = tl.sum(b * y, axis=1)
    ptrs = out_ptr + t * so0 + cols * so1
    old = tl.load(ptrs, mask=cols < N).to(tl.float32)
    tl.store(ptrs, (old + delta).to(out_ptr.dtype.element_ty), mask=cols < N)


def bgmv_shrink(
    x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, wide: bool = False
) -> torch.Tensor:
    """``wide`` (``bgmv-wide``): 16 ranks (a slice of rank 16) a program, not 4."""
    tokens, k = x.shape
    r = a.shape[1]
    y = torch.empty(tokens, r, dtype=torch.float32, device=x.device)  # (as sgmv_shrink)
    if tokens == 0:
        return y
    # NOTE: a few ranks a program and long strides of K (Punica's BGMV: a block per output):
    # a decode step's few rows still fill the device, each program reducing K in few steps.
    br, bk = (16, 256) if wide else (4, 512)
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
    wide: bool = False,
    slot_stride: int = 0,
) -> None:
    """Every slice of :func:`pagoda.ops.lora.expand` in one launch (at most three); ``wide``
    (``bgmv-wide``): blocks of 512 output columns, not 128. ``slot_stride``: a row of ``y``
    holds every slot's shrink, slot ``s``'s from column ``s * slot_stride`` (the shrink folded
    into the base GEMM as extra output columns: the ``folded`` decode kernel,
    :func:`pagoda.ops.lora.expand_folded`)."""
    n, r = b.shape[1], b.shape[2]
    if y.shape[0] == 0:
        return
    b1, b2 = _two_bounds(bounds, n)
    br = triton.next_power_of_2(r)
    bn = min(512, 16384 // br) if wide else 128  # (rank 64: a tile of B as big as at 16)
    _bgmv_expand_kernel[(y.shape[0], triton.cdiv(n, bn))](
        y, b, out, token_slots, n, r, b1, b2,
        y.stride(0), slot_stride * y.stride(1), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), BLOCK_N=bn, BLOCK_R=br, num_warps=8 if wide else 4,
    )  # fmt: skip


def _two_bounds(bounds: tuple[int, ...], n: int) -> tuple[int, int]:
    if len(bounds) > 2:
        raise ValueError(f"a LoRA decode kernel takes at most three slices, got bounds {bounds}")
    b1, b2 = (*bounds, n, n)[:2]
    return b1, b2


# ---- fused: shrink and expand in one launch (decode rows) ---------------------------------------
#
# A program owns a block of output columns inside one slice (q, k or v): the grid's last axis
# counts each slice's blocks in turn, C1 and C2 being where the second and third slice's start;
# the program recomputes its rows' rank-R shrink of that slice, which costs a read of the
# slice's A (R x K) against the expand's read of a block of B.


@triton.jit
def _slice_block(p, E1, E2, N, C1, C2, BLOCK_N: tl.constexpr):
    """Program ``p``'s slice, its output columns and the end of its slice."""
    part = (p >= C1).to(tl.int32) + (p >= C2).to(tl.int32)
    lo = tl.where(part == 0, 0, tl.where(part == 1, E1, E2))
    hi = tl.where(part == 0, E1, tl.where(part == 1, E2, N))
    c0 = tl.where(part == 0, 0, tl.where(part == 1, C1, C2))
    cols = lo + (p - c0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return part, cols, hi


@triton.jit
def _fused_rows_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr, token_slots, K, R, N, E1, E2, C1, C2,
    sx0, sx1, sa0, sa1, sa2, sb0, sb1, sb2, so0, so1,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots + t).to(tl.int64)
    if slot < 0:
        return
    part, cols, hi = _slice_block(tl.program_id(1), E1, E2, N, C1, C2, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + t * sx0 + kk * sx1, mask=kk < K, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * sa0 + (part * R + rs)[:, None] * sa1 + kk[None, :] * sa2,
            mask=(rs[:, None] < R) & (kk[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    col_ok = cols < hi
    b = tl.load(
        b_ptr + slot * sb0 + cols[:, None] * sb1 + rs[None, :] * sb2,
        mask=col_ok[:, None] & (rs[None, :] < R),
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * acc[None, :], axis=1)
    ptrs = out_ptr + t * so0 + cols * so1
    old = tl.load(ptrs, mask=col_ok).to(tl.float32)
    tl.store(ptrs, (old + delta).to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _fused_slots_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr, sorted_rows, slot_starts, K, R, N, E1, E2, C1, C2,
    sx0, sx1, sa0, sa1, sa2, sb0, sb1, sb2, so0, so1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0).to(tl.int64)
    start = tl.load(slot_starts + slot)
    end = tl.load(slot_starts + slot + 1)
    m0 = start + tl.program_id(1) * BLOCK_M
    if m0 >= end:
        return
    idx = m0 + tl.arange(0, BLOCK_M)
    row_ok = idx < end
    rows = tl.load(sorted_rows + idx, mask=row_ok, other=0).to(tl.int64)
    part, cols, hi = _slice_block(tl.program_id(2), E1, E2, N, C1, C2, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(
            x_ptr + rows[:, None] * sx0 + kk[None, :] * sx1,
            mask=row_ok[:, None] & (kk[None, :] < K),
            other=0.0,
        )
        a = tl.load(
            a_ptr + slot * sa0 + (part * R + rs)[None, :] * sa1 + kk[:, None] * sa2,
            mask=(rs[None, :] < R) & (kk[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(x, a, input_precision=PRECISION)
    col_ok = cols < hi
    b = tl.load(
        b_ptr + slot * sb0 + cols[None, :] * sb1 + rs[:, None] * sb2,
        mask=(rs[:, None] < R) & col_ok[None, :],
        other=0.0,
    )
    delta = tl.dot(acc.to(b.dtype), b, input_precision=PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    ptrs = out_ptr + rows[:, None] * so0 + cols[None, :] * so1
    old = tl.load(ptrs, mask=mask).to(tl.float32)
    tl.store(ptrs, (old + delta).to(out_ptr.dtype.element_ty), mask=mask)


def _slice_blocks(bounds: tuple[int, ...], n: int, bn: int) -> tuple[int, int, int, int, int]:
    """The slices' ends E1, E2, where the second and third slice's blocks start (C1, C2), and
    the blocks in all."""
    e1, e2 = _two_bounds(bounds, n)
    c1 = triton.cdiv(e1, bn)
    c2 = c1 + triton.cdiv(e2 - e1, bn)
    return e1, e2, c1, c2, c2 + triton.cdiv(n - e2, bn)


def fused_rows(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    bounds: tuple[int, ...] = (),
    block_n: int | None = None,
) -> None:
    """``fused-rows``: :func:`pagoda.ops.lora.add_lora` in one launch, a program a token and
    block of output columns of one slice (``block_n``; None: 512 at rank 16)."""
    tokens, k = x.shape
    n, r = b.shape[1], b.shape[2]
    if tokens == 0:
        return
    br = triton.next_power_of_2(r)
    # NOTE: tiles of A (R x BLOCK_K) and B (BLOCK_N x R) of 4096 and 8192 floats at any rank.
    bn, bk = block_n or min(512, 8192 // br), min(256, max(16, 4096 // br))
    e1, e2, c1, c2, blocks = _slice_blocks(bounds, n, bn)
    _fused_rows_kernel[(tokens, blocks)](
        x, a, b, out, token_slots, k, r, n, e1, e2, c1, c2,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BLOCK_N=bn, BLOCK_R=br, BLOCK_K=bk, num_warps=4,
    )  # fmt: skip


def fused_slots(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    sorted_rows: torch.Tensor,
    slot_starts: torch.Tensor,
    out: torch.Tensor,
    bounds: tuple[int, ...] = (),
    block_n: int | None = None,
) -> None:
    """``fused-slots``: :func:`pagoda.ops.lora.add_lora` in one launch over the rows grouped
    by slot (:func:`pagoda.ops.lora.sort_rows`), a program 16 rows of one slot and a block of
    output columns of one slice (``block_n``; None: 128)."""
    tokens, k = x.shape
    slots, n, r = b.shape
    if tokens == 0:
        return
    br = max(16, triton.next_power_of_2(r))
    # NOTE: a tile of A (BLOCK_K x R) of 4096 elements at any rank: rank 64 in float32 still
    # fits the pipelined stages in shared memory.
    bm, bn, bk = 16, block_n or 128, min(256, 4096 // br)
    e1, e2, c1, c2, blocks = _slice_blocks(bounds, n, bn)
    _fused_slots_kernel[(slots, triton.cdiv(tokens, bm), blocks)](
        x, a, b, out, sorted_rows, slot_starts, k, r, n, e1, e2, c1, c2,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br, BLOCK_K=bk, PRECISION=_precision(x.dtype),
        num_warps=4,
    )  # fmt: skip
