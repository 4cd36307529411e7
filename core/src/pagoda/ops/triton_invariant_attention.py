"""Batch-invariant paged attention in Triton: one program per (query token, KV head).

A program finds its token's request (a binary search over the query start offsets), loads the
query heads that share the KV head as the rows of one tile, and visits the keys at positions
``0..p`` in tiles of ``TILE_N`` from position 0 with an online softmax. Nothing depends on the
batch: no split of the context, no tile shared with other tokens, one compiled kernel (tile,
warps and stages are constants), so a token's output is the same bits whatever else runs and
however its prompt was chunked. Decode and prefill tokens take the same path; every launch
parameter depends on shapes only, and lengths are read from device buffers, so the kernel
replays in CUDA graphs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

TILE_N = 64  # keys per loop iteration: fixed, whatever the batch or the device
_NUM_WARPS = 4
_NUM_STAGES = 2


@triton.jit
def _request_of(qsl_ptr, tok, num_seqs):
    # The last request whose first token is at or before `tok`.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid + 1) <= tok:
            lo = mid + 1
        else:
            hi = mid
    return lo


@triton.jit
def _keys_tile(
    q,
    row_ok,
    k_cache_ptr,
    v_cache_ptr,
    bt,
    start,
    kv_hi,
    m_i,
    l_i,
    acc,
    offs_n,
    offs_d,
    d_ok,
    kv_head,
    scale,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pos = start + offs_n
    n_ok = pos < kv_hi
    blk = tl.load(bt + pos // PAGE, mask=n_ok, other=0).to(tl.int64)
    slot = pos % PAGE
    k = tl.load(
        k_cache_ptr
        + blk[None, :] * stride_kb
        + slot[None, :] * stride_ks
        + kv_head * stride_kh
        + offs_d[:, None],
        mask=n_ok[None, :] & d_ok[:, None],
        other=0.0,
    )
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
    s = tl.where(n_ok[None, :] & row_ok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_cache_ptr
        + blk[:, None] * stride_vb
        + slot[:, None] * stride_vs
        + kv_head * stride_vh
        + offs_d[None, :],
        mask=n_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_seqs"])
def _invariant_attention(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    scale,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    TILE: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tok = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _request_of(qsl_ptr, tok, num_seqs)
    q_end = tl.load(qsl_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_hi = seq_len - (q_end - tok) + 1  # keys at positions 0..p

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * G + offs_m
    row_ok = offs_m < G
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, TILE)
    bt = block_table_ptr + seq * stride_bt
    if WHILE_LOOP:
        # The interpreter cannot take tensor bounds in range(); a while loop it can.
        start = 0
        while start < kv_hi:
            m_i, l_i, acc = _keys_tile(
                q, row_ok, k_cache_ptr, v_cache_ptr, bt, start, kv_hi, m_i, l_i, acc, offs_n,
                offs_d, d_ok, kv_head, scale, stride_kb, stride_ks, stride_kh, stride_vb,
                stride_vs, stride_vh, PAGE, DOT_PRECISION,
            )  # fmt: skip
            start += TILE
    else:
        for start in range(0, kv_hi, TILE):
            m_i, l_i, acc = _keys_tile(
                q, row_ok, k_cache_ptr, v_cache_ptr, bt, start, kv_hi, m_i, l_i, acc, offs_n,
                offs_d, d_ok, kv_head, scale, stride_kb, stride_ks, stride_kh, stride_vb,
                stride_vs, stride_vh, PAGE, DOT_PRECISION,
            )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def invariant_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, page, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    out: torch.Tensor,  # like query
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    num_seqs: int,
    num_tokens: int,
    scale: float,
) -> torch.Tensor:
    """Attention of the first ``num_tokens`` query tokens into ``out``; returns ``out``."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    g = num_heads // num_kv_heads
    if num_tokens == 0:
        return out
    _invariant_attention[(num_tokens, num_kv_heads)](
        query,
        key_cache,
        value_cache,
        out,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        num_seqs,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        G=g,
        BLOCK_M=max(16, triton.next_power_of_2(g)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        PAGE=page,
        TILE=TILE_N,
        WHILE_LOOP=os.environ.get("TRITON_INTERPRET") == "1",
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )
    return out
