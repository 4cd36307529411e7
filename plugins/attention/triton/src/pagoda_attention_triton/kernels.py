"""Paged attention in Triton: one kernel for a mixed batch, with optional split-KV (flash-decoding).

Each program handles ``BLOCK_Q`` query tokens of one request for one KV head, with all the query
heads that share that KV head (grouped-query attention) stacked into ``BLOCK_M`` rows, so K and V
are read once per group. Keys are visited in tiles of ``TILE_N`` tokens gathered through the block
table, with causal masking against each query's position, and an online softmax. With
``num_splits > 1`` each program covers one slice of the context and writes a partial result
(output and log-sum-exp) that a second kernel merges, so a few long sequences still fill the GPU.

Decode steps may give an ``order`` of the requests (longest context first): unsplit, they then
run ``_paged_decode``, a program per (request, KV head) started in that order, so the last
programs on the GPU are the shortest and the programs sharing a multiprocessor cover each
other's starts.

Every path computes the layer's :class:`~pagoda.attention.spec.AttentionSpec` extras, each
behind a ``constexpr`` flag so a plain layer compiles none of it (its kernels are instruction for
instruction those from before the extras). A sliding window (``WINDOW``: a query at ``i`` sees
keys ``i - window < j <= i``) and chunks (``CHUNK``: keys ``i // chunk * chunk <= j <= i``) give
each query a first key: keys below it are masked, and the tiles wholly below the first key of a
program's first query are not visited at all. A logit soft-cap (``SOFTCAP``) makes logits ``c *
tanh(logits / c)`` before masking. Sink logits (``SINKS``, one a query head) put ``exp(sink)`` in
the softmax's denominator, at the end of the online softmax or in the split merge's log-sum-exp.

A bidirectional layer (``CAUSAL`` off, encoders) lets every query see every key of its request
(``j < seq_len``): a program visits its request's keys to the last, not to its last query. With
a window (``|i - j| < window``) or chunks (``j // chunk == i // chunk``) each query then has a
last key as well as a first (``_last_key``), above which keys are masked and tiles, past the
last key of a program's last query, not visited. A step of one query a request computes the same
either way (each query is its request's last token), so it runs the causal kernels:
``_paged_decode`` has no such flag.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from pagoda.ops.launch import JitLaunch

# NOTE: the split count is a runtime value (a constexpr would compile the kernels again for each
# count a step meets; at batch 1 a growing context meets each in turn): the merge reads the
# backend's most, masked.
from pagoda_attention_triton.backend import MAX_SPLITS


@triton.jit
def _find_seq(qsl_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    # The request whose q-blocks contain program `target` (q-blocks of request i start at
    # qsl[i] // BLOCK_Q + i, an upper bound that keeps the search branch-free per request).
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        val = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if val <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _fp16_query(q, FP16: tl.constexpr):
    """With ``FP16`` (an FP8 cache whose value pages are transposed), a bfloat16 query as
    float16, so that the dots take keys and values converted from FP8 by one instruction a pair
    (e4m3 to f16 is native from sm89; to bf16 it goes on through f32, a second instruction a
    value). A bfloat16 value converts exactly within float16's range; beyond it, clamped."""
    if FP16:
        if q.dtype == tl.bfloat16:
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def _tile(
    q,
    q_pos,
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
    q_lo,
    q_hi,
    softcap,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOCAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    FP8_KV: tl.constexpr,
    VALUES_T: tl.constexpr,
):
    """One tile of keys: scores (soft-capped), causal mask (and with ``LOCAL``, each row's first
    key ``q_lo``: a window's or a chunk's), online-softmax update of (m, l, acc). Without
    ``CAUSAL`` a row sees the keys below ``kv_hi`` (its request's, or its split's), and with
    ``LOCAL`` those below its own end ``q_hi`` (exclusive) too."""
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
    if FP8_KV:  # (its scale is in ``scale``)
        k = k.to(q.dtype)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
    if SOFTCAP:
        # c * tanh(s / c) as c - 2c / (exp(2s / c) + 1): one exp, as exact as the softmax's,
        # where libdevice's tanh is an external call the interpreter cannot run. Saturates
        # cleanly: exp overflows to inf (-> c) or underflows to 0 (-> -c).
        s = softcap - (2.0 * softcap) / (tl.exp(s * (2.0 / softcap)) + 1.0)
    if CAUSAL:
        ok = n_ok[None, :] & (pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
    else:
        ok = n_ok[None, :] & row_ok[:, None]
    if LOCAL:
        ok = ok & (pos[None, :] >= q_lo[:, None])
        if not CAUSAL:
            ok = ok & (pos[None, :] < q_hi[:, None])
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_offs = (
        blk[:, None] * stride_vb
        + slot[:, None] * stride_vs
        + kv_head * stride_vh
        + offs_d[None, :] * stride_vd
    )
    if VALUES_T:
        # Transposed value pages (`transposed_values`): a page's keys are contiguous, and a
        # tile starts on a page (or, pages longer than a tile, on a tile) boundary: vector
        # loads along the keys. Read whole: a key past the request (or its block-table padding,
        # the null block) holds a finite value (the cache starts zeroed, writes clamp), and its
        # p is 0.
        run: tl.constexpr = min(PAGE, offs_n.shape[0])
        v_offs = tl.max_contiguous(tl.multiple_of(v_offs, [run, 1]), [run, 1])
        v = tl.load(v_cache_ptr + v_offs, mask=d_ok[None, :], other=0.0)
    else:
        v = tl.load(v_cache_ptr + v_offs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8_KV:  # (its scale multiplies the output)
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _denominator(l_i, m_i, sinks_ptr, head, row_ok, SINKS: tl.constexpr):
    """The softmax's denominator of rows whose running max is ``m_i`` and sum ``l_i``: with
    ``SINKS``, plus ``exp(sink - m_i)`` of each row's head (its sink logit shares the softmax but
    brings no value); 1 where a row saw nothing, so that its output is 0, not NaN."""
    if SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        l_i = l_i + tl.exp(sink - tl.where(m_i > float("-inf"), m_i, 0.0))
    return tl.where(l_i > 0, l_i, 1.0)


@triton.jit
def _first_key(q_pos, window, chunk, WINDOW: tl.constexpr, CHUNK: tl.constexpr):
    """The first key a query at ``q_pos`` sees: its window's (``q_pos - window + 1``), its
    chunk's (``q_pos // chunk * chunk``), the later of the two, 0 at least. It never decreases
    with ``q_pos``: a program's first query has the lowest of its rows. A program visits keys
    from that one's down to a tile boundary: the tiles stay those of the unwindowed loop, the
    ones below are skipped, and a split's slices stay tile-aligned."""
    lo = q_pos * 0
    if WINDOW:
        lo = tl.maximum(lo, q_pos - window + 1)
    if CHUNK:
        lo = tl.maximum(lo, q_pos // chunk * chunk)
    return lo


@triton.jit
def _last_key(q_pos, seq_len, window, chunk, WINDOW: tl.constexpr, CHUNK: tl.constexpr):
    """A bidirectional query's end of keys (exclusive): its request's (``seq_len``), its
    window's (``q_pos + window``), its chunk's (``(q_pos // chunk + 1) * chunk``), the earliest.
    It never decreases with ``q_pos``: a program's last query has the highest of its rows."""
    hi = q_pos * 0 + seq_len
    if WINDOW:
        hi = tl.minimum(hi, q_pos + window)
    if CHUNK:
        hi = tl.minimum(hi, (q_pos // chunk + 1) * chunk)
    return hi


# NOTE: the request count and split size change from step to step; left to specialize, Triton
# compiles a variant for each of 1, a multiple of 16 and any other value, and a step that meets
# one for the first time (a prefill of 29 requests after a start-up that ran 256) waits about
# half a second for it. The window and chunk are a layer's and fixed, but a multiple of 16 or
# not would compile them twice for nothing.
@triton.jit(do_not_specialize=["num_seqs", "split_size", "num_splits", "window", "chunk"])
def _paged_attention(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    order_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    window,
    chunk,
    softcap,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_bt,
    num_seqs,
    split_size,
    num_splits,
    G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    ORDERED: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    CHUNK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    CAUSAL: tl.constexpr,
    FP8_KV: tl.constexpr,
    VALUES_T: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(2)
    v_mul = 1.0
    if FP8_KV:  # keys and values stored as fp8(x / scale): the scales fold into the arithmetic
        scale = scale * tl.load(k_scale_ptr)
        v_mul = tl.load(v_scale_ptr)
    if ORDERED:
        # One program a (request, KV head), every request's queries in one q-block, requests
        # taken in the order `order_ptr` gives (longest context first) with their KV heads
        # together: the multiprocessors start on the longest work and the last wave holds the
        # shortest, so no long program runs on alone at the end.
        seq = tl.load(order_ptr + pid // NUM_KV_HEADS)
        kv_head = pid % NUM_KV_HEADS
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        q_block = 0
    else:
        kv_head = tl.program_id(1)
        seq = _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        q_block = pid - (q_start // BLOCK_Q + seq)
        if q_block * BLOCK_Q >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_tok = q_block * BLOCK_Q + offs_m // G
    head = kv_head * G + offs_m % G
    row_ok = (offs_m < BLOCK_Q * G) & (q_tok < q_len)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr
        + (q_start + q_tok)[:, None] * stride_qt
        + head[:, None] * stride_qh
        + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = _fp16_query(q, FP8_KV and VALUES_T)
    q_pos = context_len + q_tok
    q_lo = _first_key(q_pos, window, chunk, WINDOW, CHUNK)
    q_hi = q_lo  # unread when causal
    if not CAUSAL:
        q_hi = _last_key(q_pos, seq_len, window, chunk, WINDOW, CHUNK)

    # Keys this program visits: causal bound of its last query (bidirectional: its request's
    # last key, or its last query's window's or chunk's), first key of its first (window or
    # chunk), then its split's slice of what lies between (the splits cut the window).
    last_q = tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    if CAUSAL:
        kv_end = tl.minimum(seq_len, context_len + last_q)
    else:
        kv_end = _last_key(context_len + last_q - 1, seq_len, window, chunk, WINDOW, CHUNK)
    if WINDOW or CHUNK:
        kv_lo = split * split_size
        first = _first_key(context_len + q_block * BLOCK_Q, window, chunk, WINDOW, CHUNK)
        kv_lo += first // TILE_N * TILE_N
    elif SPLIT:
        # The splits share this program's own keys, in whole tiles: a graph is captured at the
        # longest context it may replay with, and slices of that length left most programs
        # idle on shorter contexts and a few walking their whole slice (at batch 1, SmolLM2's
        # 3 KV heads, 2,048 captured: 4 slices of 512 keys, 12 programs on 132 multiprocessors).
        split_size = tl.cdiv(tl.cdiv(kv_end, num_splits), TILE_N) * TILE_N
        kv_lo = split * split_size
    else:
        kv_lo = 0
    kv_hi = tl.minimum(kv_end, kv_lo + split_size)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    bt = block_table_ptr + seq * stride_bt
    if WHILE_LOOP:
        # The interpreter (NumPy 2) cannot take tensor bounds in range(); a while loop it can.
        start = kv_lo
        while start < kv_hi:
            m_i, l_i, acc = _tile(
                q,
                q_pos,
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
                q_lo,
                q_hi,
                softcap,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_vb,
                stride_vs,
                stride_vh,
                stride_vd,
                PAGE,
                DOT_PRECISION,
                WINDOW or CHUNK,
                SOFTCAP,
                CAUSAL,
                FP8_KV,
                VALUES_T,
            )
            start += TILE_N
    else:
        for start in range(kv_lo, kv_hi, TILE_N):
            m_i, l_i, acc = _tile(
                q,
                q_pos,
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
                q_lo,
                q_hi,
                softcap,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_vb,
                stride_vs,
                stride_vh,
                stride_vd,
                PAGE,
                DOT_PRECISION,
                WINDOW or CHUNK,
                SOFTCAP,
                CAUSAL,
                FP8_KV,
                VALUES_T,
            )

    tok = q_start + q_tok
    if FP8_KV:
        acc = acc * v_mul
    if not SPLIT:
        out = acc / _denominator(l_i, m_i, sinks_ptr, head, row_ok, SINKS)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # Partials: [tokens, heads, splits, dim] and [tokens, heads, splits], without the sinks
        # (the merge adds each once).
        num_heads = NUM_KV_HEADS * G
        base = (tok * num_heads + head) * num_splits + split
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            part_out_ptr + base[:, None] * HEAD_DIM_PAD + offs_d[None, :], out, mask=row_ok[:, None]
        )
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + base, lse, mask=row_ok)


_paged_attention_launch = JitLaunch(_paged_attention)


@triton.jit(do_not_specialize=["window", "chunk"])
def _paged_decode(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    order_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    window,
    chunk,
    softcap,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_bt,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    CHUNK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    FP8_KV: tl.constexpr,
    VALUES_T: tl.constexpr,
):
    """Decode (one query a request, no split): a program takes ``HEADS_PER_PROGRAM`` KV heads
    of one request, requests in ``order_ptr``'s order. One head (the default) is a plain loop
    over its key tiles; more are one loop over (head, key tile): the loads of a head's first
    tiles are issued while the previous head's last tiles are reduced, where a program a head
    would start each head with its pipeline empty. Each head's arithmetic
    is that of ``_paged_attention``'s decode programs, tile for tile (a window's or chunk's
    first tile is theirs too)."""
    pid = tl.program_id(0)
    v_mul = 1.0
    if FP8_KV:  # keys and values stored as fp8(x / scale): the scales fold into the arithmetic
        scale = scale * tl.load(k_scale_ptr)
        v_mul = tl.load(v_scale_ptr)
    groups: tl.constexpr = NUM_KV_HEADS // HEADS_PER_PROGRAM
    seq = tl.load(order_ptr + pid // groups)
    head0 = (pid % groups) * HEADS_PER_PROGRAM
    tok = tl.load(qsl_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    row_ok = offs_m < G
    d_ok = offs_d < HEAD_DIM
    io_ok = row_ok[:, None] & d_ok[None, :]
    q_pos = tl.zeros([BLOCK_M], tl.int32) + (seq_len - 1)
    q_lo = _first_key(q_pos, window, chunk, WINDOW, CHUNK)
    bt = block_table_ptr + seq * stride_bt
    n_tiles = tl.cdiv(seq_len, TILE_N)
    # Each head's tiles: t0 .. n_tiles - 1 (with a window or chunks, from its first key's tile).
    t0 = 0
    if WINDOW or CHUNK:
        t0 = _first_key(seq_len - 1, window, chunk, WINDOW, CHUNK) // TILE_N
    per_head = n_tiles - t0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    if HEADS_PER_PROGRAM == 1:
        # One head: its query loaded once, its output stored once after the loop. (The loop
        # over (head, tile) below reloads the query, resets the softmax's state and issues its
        # masked store at every tile: at Llama-3.1-8B's heads over an FP8 cache, batch 256,
        # contexts around 640, on an H200 that loop took 147.8 us where this one takes 122.1
        # at the same launch; bfloat16 156.9 and 153.9.)
        head = head0 * G + offs_m % G
        q = tl.load(
            q_ptr + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=io_ok,
            other=0.0,
        )
        q = _fp16_query(q, FP8_KV and VALUES_T)
        for t in range(t0, n_tiles):
            m_i, l_i, acc = _tile(
                q,
                q_pos,
                row_ok,
                k_cache_ptr,
                v_cache_ptr,
                bt,
                t * TILE_N,
                seq_len,
                m_i,
                l_i,
                acc,
                offs_n,
                offs_d,
                d_ok,
                head0,
                scale,
                q_lo,
                q_lo,  # unread: causal
                softcap,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_vb,
                stride_vs,
                stride_vh,
                stride_vd,
                PAGE,
                DOT_PRECISION,
                WINDOW or CHUNK,
                SOFTCAP,
                True,  # a decode query is its request's last token: bidirectional is causal
                FP8_KV,
                VALUES_T,
            )
        if FP8_KV:
            acc = acc * v_mul
        out = acc / _denominator(l_i, m_i, sinks_ptr, head, row_ok, SINKS)[:, None]
        tl.store(
            out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_ok & ((offs_m * 0 + per_head) > 0)[:, None],  # (nothing without a tile)
        )
        return
    for it in range(0, HEADS_PER_PROGRAM * per_head):
        h = it // per_head
        t = t0 + it - h * per_head
        kv_head = head0 + h
        head = kv_head * G + offs_m % G
        first = t == t0
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        q = tl.load(
            q_ptr + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=io_ok,
            other=0.0,
        )
        q = _fp16_query(q, FP8_KV and VALUES_T)
        m_i, l_i, acc = _tile(
            q,
            q_pos,
            row_ok,
            k_cache_ptr,
            v_cache_ptr,
            bt,
            t * TILE_N,
            seq_len,
            m_i,
            l_i,
            acc,
            offs_n,
            offs_d,
            d_ok,
            kv_head,
            scale,
            q_lo,
            q_lo,  # unread: causal
            softcap,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_vd,
            PAGE,
            DOT_PRECISION,
            WINDOW or CHUNK,
            SOFTCAP,
            True,  # a decode query is its request's last token: bidirectional is causal
            FP8_KV,
            VALUES_T,
        )
        scaled = acc
        if FP8_KV:
            scaled = acc * v_mul
        out = scaled / _denominator(l_i, m_i, sinks_ptr, head, row_ok, SINKS)[:, None]
        tl.store(
            out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_ok & ((offs_m * 0 + t) == n_tiles - 1)[:, None],  # the head's last tile
        )


_paged_decode_launch = JitLaunch(_paged_decode)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    sinks_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Each (token, head)'s split partials weighted by their share of the softmax: ``exp(lse)``
    over the splits' sum, plus ``exp(sink)`` with ``SINKS`` (a share that brings no value)."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, MAX_SPLITS)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    base = (tok * num_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m = tl.maximum(m, sink)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.exp(lse - m)
    denom = tl.sum(w, 0)
    if SINKS:
        denom += tl.exp(sink - m)
    w = w / denom
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0)
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


_merge_splits_launch = JitLaunch(_merge_splits)


def transposed_values(kv_cache: torch.Tensor) -> torch.Tensor:
    """The value pages of ``kv_cache`` (``[2, num_blocks, block_size, num_kv_heads,
    head_size]``, contiguous) stored transposed, each page as ``[num_kv_heads, head_size,
    block_size]`` in the same bytes, viewed as ``[num_blocks, block_size, num_kv_heads,
    head_size]``: the same indices as the default layout's value cache, other strides.

    A decode step reads values as the second operand of ``p . v``, whose elements pair along
    the keys: stored a token a row, 16-bit values reach it by transposing shared-memory loads,
    one-byte (FP8) values only a byte at a time; stored transposed, their keys are contiguous.
    """
    num_blocks, page, heads, size = kv_cache.shape[1:]
    pages = kv_cache[1].view(num_blocks, heads, size, page)
    return pages.permute(0, 3, 1, 2)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, page, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    out: torch.Tensor,  # like query
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    num_seqs: int,
    num_tokens: int,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    num_splits: int = 1,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_m: int | None = None,
    order: torch.Tensor | None = None,
    heads_per_program: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    causal: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``tile_n`` (keys a loop iteration reads), ``num_warps``, ``num_stages`` and ``block_m``
    (query rows a program holds: query tokens x the heads of a KV head) override the launch
    heuristics (tuning benchmarks use them).

    ``order`` (int32, ``[num_seqs]``, a permutation of the requests; decode steps only, one
    query a request) is the order the requests' programs start in: longest context first keeps
    the last wave of programs short (:func:`longest_first`). Unsplit, a program then takes
    ``heads_per_program`` of a request's KV heads in one pipelined loop (default 1, which runs a
    plain loop of its own: at batch 256 on an H200, Llama-3.1-8B's heads, it read a bf16 cache
    in 153.9 us against two heads' 156.9, and an FP8 cache in 122.1 against 147.8; 4 or 8 heads
    lost earlier: too few programs to even out the end).

    ``sliding_window``, ``logit_softcap``, ``sinks`` (``[num_heads]``, any float dtype) and
    ``chunk_size`` are the layer's :class:`~pagoda.attention.spec.AttentionSpec` extras (None:
    off, and not compiled in). With a window or chunks, ``num_splits`` slices cut the keys a
    query can see, not its context. ``causal=False`` is a bidirectional layer's: each query sees
    its request's keys on both sides (within its window and its chunk); a step of one query a
    request (``max_query_len == 1``) runs the causal kernels, which compute the same for it.

    An FP8 cache (``float8_e4m3fn``) holds ``fp8(key / k_scale)`` and ``fp8(value / v_scale)``:
    ``k_scale`` and ``v_scale`` (float32 ``[1]``, on the device, read there so that a CUDA
    graph sees later values) fold into the logits' scale and the output."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    g = num_heads // num_kv_heads
    # Prefill chunks of long prompts: 128 query rows a program, 32 keys a tile, 8 warps, 2 stages
    # took 333 us where 64 rows, 64 keys, 4 warps, 3 stages took 428 (28 prompts of 100 - 1024
    # tokens, Qwen3-0.6B's heads, H200: triton_decode_tuning.py --prefill 28). Verification
    # steps (a few queries a request) keep 64 rows: most of 128 would be empty.
    long_prefill = max_query_len >= 128 and head_dim <= 128
    if block_m is None:
        # A verification step's few queries a request (times the heads of a KV head) fill 16 or
        # 32 rows: 64 would leave most of each program's dots on padding (issue 44: in float32,
        # IEEE dots without tensor cores, that padding was most of a verification's time).
        short = max_query_len * g <= 32
        block_m = 16 if max_query_len == 1 else 128 if long_prefill else 64
        if short and max_query_len > 1:
            block_m = max(16, triton.next_power_of_2(max_query_len * g))
    block_m = max(block_m, triton.next_power_of_2(g))
    block_q = block_m // g
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # Decode reads keys faster in longer tiles with a shallower pipeline: at Llama-3.1-8B's heads,
    # batch 256, contexts around 640, 84% of the copy bandwidth against 78% for prefill's 64 keys
    # and 3 stages on an H200 (benchmarks/triton_decode_tuning.py).
    decode_tile = max_query_len == 1 and head_dim <= 128
    # Ordered, unsplit decode (`_paged_decode`) reads 64-key tiles: three programs fit a
    # multiprocessor's shared memory where 128-key tiles fit one, and the others' loads cover a
    # program's start. Qwen3-0.6B's heads, batch 256, contexts 120 - 1080, CUDA graphs on an
    # H200: 148.6 us, 0.96 of the copy bandwidth, against 159.9 with 128-key tiles and 165.1
    # for the one-head programs in batch order (triton_decode_tuning.py --heads-per-program).
    ordered_decode = order is not None and num_splits == 1 and decode_tile
    if tile_n is None:
        if ordered_decode:
            tile_n = 64
        elif decode_tile:
            tile_n = 128
        elif long_prefill:
            tile_n = 32
        else:
            tile_n = 64 if head_dim <= 128 else 32
    if num_stages is None and (decode_tile or long_prefill or block_m <= 32):
        # (a verification's 16 or 32 rows too: 7.1 us a layer against 7.5 in 3 stages at batch 1,
        # SmolLM2's heads, 9 queries, 32 slices of 64 keys; benchmarks/small_batch_attention.py)
        num_stages = 2
    if num_warps is None and long_prefill:
        num_warps = 8
    if num_warps is None and ordered_decode and key_cache.dtype == torch.float8_e4m3fn:
        # An FP8 cache's programs convert what they read (one instruction a pair of values)
        # and read half the bytes: one warp a program, more programs resident, read it faster.
        # Llama-3.1-8B's heads, batch 256, H200: 106.6 us at contexts around 640 (0.72 of
        # the copy bandwidth) against 122.1 with four warps and 112.3 with two; 335.9 against
        # 388.7 around 2,048. (A bfloat16 cache reads slower so: 221.1 against 153.9.)
        num_warps = 1
    launch = {}
    if num_warps is not None:
        launch["num_warps"] = num_warps
    if num_stages is not None:
        launch["num_stages"] = num_stages
    grid_q = num_tokens // block_q + num_seqs
    if order is not None and max_query_len != 1:
        raise ValueError("an order of requests is for decode steps, one query a request")
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be [num_heads] = [{num_heads}], not {list(sinks.shape)}")
        sinks = sinks.contiguous()  # the kernels index it by head
    fp8_kv = key_cache.dtype == torch.float8_e4m3fn
    if fp8_kv and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache is read with its k_scale and v_scale")
    values_t = value_cache.stride(1) == 1 and value_cache.stride(3) != 1
    if values_t and page & (page - 1):
        # (the kernels read a tile's values in runs of min(page, tile) keys from tile starts)
        raise ValueError(f"transposed value pages need a power-of-two block size, not {page}")
    # Each value is unread without its flag (the query stands in for absent sinks and scales).
    spec_args = (
        query if sinks is None else sinks,
        k_scale if fp8_kv else query,
        v_scale if fp8_kv else query,
        scale,
        sliding_window or 1,
        chunk_size or 1,
        logit_softcap or 1.0,
    )
    # NOTE: a query that is its request's last token sees the same keys either way; a decode
    # step of a bidirectional layer compiles no kernel of its own (and `_paged_decode` none).
    causal = causal or max_query_len == 1
    flags = {
        "WINDOW": sliding_window is not None,
        "CHUNK": chunk_size is not None,
        "SOFTCAP": logit_softcap is not None,
        "SINKS": sinks is not None,
        "FP8_KV": fp8_kv,
        # value pages stored transposed (`transposed_values`): keys contiguous in a page
        "VALUES_T": values_t,
    }
    strides = (
        *query.stride()[:2],
        *key_cache.stride()[:3],
        *value_cache.stride()[:4],
        *out.stride()[:2],
        block_table.stride(0),
    )
    # float32 inputs mean float32 arithmetic: no silent TF32 rounding in the dots.
    dot_precision = "ieee" if query.dtype == torch.float32 else "tf32"
    if order is not None and num_splits == 1:
        hpp = heads_per_program or 1
        if num_kv_heads % hpp:
            raise ValueError(f"heads_per_program {hpp} does not divide {num_kv_heads} KV heads")
        _paged_decode_launch(
            (num_seqs * num_kv_heads // hpp,),
            query,
            key_cache,
            value_cache,
            out,
            block_table,
            seq_lens,
            query_start_loc,
            order,
            *spec_args,
            *strides,
            G=g,
            BLOCK_M=block_m,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            PAGE=page,
            TILE_N=tile_n,
            NUM_KV_HEADS=num_kv_heads,
            HEADS_PER_PROGRAM=hpp,
            DOT_PRECISION=dot_precision,
            **flags,
            **launch,
        )
        return out
    if order is not None:
        grid = (num_seqs * num_kv_heads, 1, num_splits)
    else:
        grid = (grid_q, num_kv_heads, num_splits)
    # The keys one program may have to visit: its context, or with a window or chunks, from
    # its first query's first key (window or chunk: at most `local - 1` below it, then down to
    # a tile boundary, `tile_n - 1` more) to its last query (`block_q - 1` past the first), and
    # bidirectional, to that one's last key (`local - 1` further at most).
    span = max(max_seq_len, 1)
    for local in (sliding_window, chunk_size):
        if local is not None:
            reach = local + block_q + tile_n - 2
            span = min(span, reach if causal else reach + local - 1)
    split_size = triton.cdiv(span, num_splits)
    split_size = triton.cdiv(split_size, tile_n) * tile_n
    if num_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim_pad),
            dtype=torch.float32,
            device=query.device,
        )
        part_lse = torch.full(
            (num_tokens, num_heads, num_splits),
            float("-inf"),
            dtype=torch.float32,
            device=query.device,
        )
    else:
        part_out = part_lse = out  # unused
    _paged_attention_launch(
        grid,
        query,
        key_cache,
        value_cache,
        out,
        part_out,
        part_lse,
        block_table,
        seq_lens,
        query_start_loc,
        query_start_loc if order is None else order,  # unread without an order
        *spec_args,
        *strides,
        num_seqs,
        split_size,
        num_splits,
        G=g,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE=page,
        TILE_N=tile_n,
        SPLIT=num_splits > 1,
        NUM_KV_HEADS=num_kv_heads,
        ORDERED=order is not None,
        WHILE_LOOP=os.environ.get("TRITON_INTERPRET") == "1",
        DOT_PRECISION=dot_precision,
        **flags,
        CAUSAL=causal,
        **launch,
    )
    if num_splits > 1:
        _merge_splits_launch(
            (num_tokens, num_heads),
            part_out,
            part_lse,
            out,
            spec_args[0],
            out.stride(0),
            out.stride(1),
            num_heads,
            num_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            MAX_SPLITS=max(MAX_SPLITS, triton.next_power_of_2(num_splits)),
            SINKS=sinks is not None,
        )
    return out


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """The requests' indices by descending length (ties in their own order), int32: the
    ``order`` of :func:`paged_attention`."""
    return np.argsort(-np.asarray(seq_lens, dtype=np.int64), kind="stable").astype(np.int32)
