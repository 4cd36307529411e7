"""Attention of fresh prompts over their own keys: a ragged ("varlen") flash-attention forward.

A step whose every request is a new prompt (no cached context: each request's ``seq_len`` is its
query length) needs no paged cache to attend: each request's keys and values are its own rows of
the step's ``key`` and ``value`` (``[num_tokens, num_kv_heads, head_dim]``, the tensors the layer
has just written into the cache). Reading them there, in contiguous tiles, saves the block-table
gather of :func:`~pagoda_attention_triton.kernels.paged_attention`, and a launch shaped for long
prompts does the rest: the Triton fused-attention tutorial's forward, cut to ragged requests and
grouped-query heads.

Each program holds ``BLOCK_M`` query rows of one request: ``BLOCK_M // heads_per_program``
tokens times ``heads_per_program`` query heads of one KV head (1: a program a query head, as the
tutorial; more: the heads that share keys stacked, as the paged kernel stacks them). The grid's
first axis enumerates every request's query blocks (request ``i``'s start at ``qsl[i] //
BLOCK_Q + i``, found by a binary search), taken last block first so that the longest programs of
a causal step start first; its second, the query heads. Keys come in tiles of ``BLOCK_N``: causal,
the tiles wholly below a program's first query run without masks, and only the diagonal ones
mask; bidirectional, every tile but the request's last runs unmasked. An online softmax in
float32 with ``exp2`` (the scale folded with ``log2(e)``) carries the rows across tiles.

Float32 inputs use IEEE dots (no TF32), as the paged kernel; head dims that are not a power of
two are padded (masked loads). A layer's window, chunks, soft-cap, sinks, an FP8 cache or any
cached context take the paged kernel: this one computes plain attention, causal or not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import cache

import torch
import triton
import triton.language as tl

from pagoda.ops.launch import JitLaunch
from pagoda_attention_triton.kernels import _find_seq


@dataclass(frozen=True)
class RaggedLaunch:
    """A launch of :func:`ragged_prefill_attention`: query rows a program (``block_m``), keys a
    tile (``block_n``), warps, pipeline stages, and query heads a program (stacked rows)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    heads_per_program: int = 1


# NOTE: the defaults, in one place: (largest padded head dim, float32 inputs) -> launch. 16-bit
# inputs at a head dim of 128 take the launch an H200 measured fastest (below; the tutorial's
# 128 rows, 64-key tiles, 8 warps and 3 stages were slower on both workloads); float32
# inputs, whose IEEE dots hold their operands in registers, the largest tiles that do
# not spill there (64 rows and 32 keys at 4 warps spill 4.6 KB a thread at head dim 128).
# `benchmarks/attention_kernels.py --ragged-prefill` measures the alternatives.
DEFAULT_LAUNCHES: dict[tuple[int, bool], RaggedLaunch] = {
    (64, False): RaggedLaunch(128, 64, 4, 3),
    # H200, Qwen3-0.6B's heads, bf16 (benchmarks/attention_kernels.py --ragged-prefill, at
    # e749d94): 140 us for 32 prompts of 512 tokens (245 TFLOP/s) and 193 us for 28 of 100 -
    # 1024 (270), against 177 and 238 at (128, 64, 8, 3) and the paged kernel's 219 and 325.
    (128, False): RaggedLaunch(64, 32, 4, 3, 2),
    (256, False): RaggedLaunch(64, 32, 8, 2),
    (64, True): RaggedLaunch(64, 32, 8, 2),
    (128, True): RaggedLaunch(32, 16, 8, 2),
    (256, True): RaggedLaunch(32, 16, 8, 2),
}


def _head_dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


@cache  # (asked for by every layer of every fresh step)
def default_launch(
    head_dim: int, dtype: torch.dtype, device: torch.device, group: int = 1
) -> RaggedLaunch:
    """The launch :data:`DEFAULT_LAUNCHES` gives inputs of ``dtype`` and ``head_dim``, made to
    fit ``device``'s shared memory (:func:`_fit`), with one query head a program where its heads
    a program do not divide ``group`` (the query heads of a KV head: odd groups, or one)."""
    pad = _head_dim_pad(head_dim)
    bound = next(b for b in (64, 128, 256) if pad <= b)
    launch = DEFAULT_LAUNCHES[(bound, dtype == torch.float32)]
    if group % launch.heads_per_program:
        launch = replace(launch, heads_per_program=1)
    return _fit(launch, pad, dtype.itemsize, device)


@cache
def _shared_memory(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", 0) or 0


def _fit(
    launch: RaggedLaunch, head_dim_pad: int, itemsize: int, device: torch.device
) -> RaggedLaunch:
    """``launch`` with fewer stages, then shorter tiles, until its tiles (the query block and
    each stage's keys and values: an upper bound of what the compiler allocates) fit the
    device's shared memory: a default meant for an H200 that a smaller GPU would refuse."""
    limit = _shared_memory(device.index or 0) if device.type == "cuda" else 0
    if not limit:
        return launch
    while True:
        need = (launch.block_m + 2 * launch.block_n * launch.num_stages) * head_dim_pad * itemsize
        if need <= limit or (launch.num_stages == 1 and launch.block_n == 16):
            return launch
        if launch.num_stages > 2:
            launch = replace(launch, num_stages=launch.num_stages - 1)
        elif launch.block_n > 16:
            launch = replace(launch, block_n=launch.block_n // 2)
        else:
            launch = replace(launch, num_stages=1)


@triton.jit
def _ragged_tile(
    q,
    k_ptrs,
    v_ptrs,
    start,
    m_i,
    l_i,
    acc,
    offs_n,
    d_ok,
    tok,
    q_len,
    qk_scale,
    stride_kt,
    stride_vt,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    PADDED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One tile of keys ``start..start + BLOCK_N``: logits, (with ``MASK``) the tile's keys past
    the request, and causal, past each row's token, then the online-softmax update in base 2."""
    pos = start + offs_n
    if MASK:
        n_ok = pos < q_len
        if PADDED:
            k_mask = n_ok[None, :] & d_ok[:, None]
            v_mask = n_ok[:, None] & d_ok[None, :]
        else:
            k_mask = n_ok[None, :]
            v_mask = n_ok[:, None]
        k = tl.load(k_ptrs + start * stride_kt, mask=k_mask, other=0.0)
    elif PADDED:
        k = tl.load(k_ptrs + start * stride_kt, mask=d_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs + start * stride_kt)
    s = tl.dot(q, k, input_precision=DOT_PRECISION)
    if MASK:
        if CAUSAL:
            ok = pos[None, :] <= tok[:, None]  # (a valid row's token is inside the request)
        else:
            ok = n_ok[None, :]
        s = tl.where(ok, s, float("-inf"))
    # NOTE: every row sees a key in the first tile it visits (key 0, or a causal program's first
    # diagonal key, at or below each of its tokens), so m_new is finite from there on.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASK:
        v = tl.load(v_ptrs + start * stride_vt, mask=v_mask, other=0.0)
    elif PADDED:
        v = tl.load(v_ptrs + start * stride_vt, mask=d_ok[None, :], other=0.0)
    else:
        v = tl.load(v_ptrs + start * stride_vt)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _ragged_tiles(
    q,
    k_ptrs,
    v_ptrs,
    lo,
    hi,
    m_i,
    l_i,
    acc,
    offs_n,
    d_ok,
    tok,
    q_len,
    qk_scale,
    stride_kt,
    stride_vt,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    PADDED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
):
    """The tiles from ``lo`` to ``hi`` (``lo`` tile-aligned)."""
    if WHILE_LOOP:
        # The interpreter (NumPy 2) cannot take tensor bounds in range(); a while loop it can.
        start = lo
        while start < hi:
            m_i, l_i, acc = _ragged_tile(
                q, k_ptrs, v_ptrs, start, m_i, l_i, acc, offs_n, d_ok, tok, q_len, qk_scale,
                stride_kt, stride_vt, MASK, CAUSAL, PADDED, DOT_PRECISION,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _ragged_tile(
                q, k_ptrs, v_ptrs, start, m_i, l_i, acc, offs_n, d_ok, tok, q_len, qk_scale,
                stride_kt, stride_vt, MASK, CAUSAL, PADDED, DOT_PRECISION,
            )  # fmt: skip
    return m_i, l_i, acc


# NOTE: the request count and the grid's size change from step to step; left to specialize,
# Triton would compile a variant for 1, multiples of 16 and other values of each. The group
# size is read once a program (its KV head): a runtime value, not a variant per model.
@triton.jit(do_not_specialize=["num_seqs", "num_q_blocks", "group"])
def _ragged_prefill(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    qsl_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    num_seqs,
    num_q_blocks,
    group,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PADDED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
):
    pid = num_q_blocks - 1 - tl.program_id(0)  # a request's last (longest) query block first
    head0 = tl.program_id(1) * HEADS_PER_PROGRAM
    seq = _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    base = q_start.to(tl.int64)  # (token offsets times strides can pass 2**31)
    kv_head = head0 // group

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    tok = q_block * BLOCK_Q + offs_m // HEADS_PER_PROGRAM
    head = head0 + offs_m % HEADS_PER_PROGRAM
    row_ok = tok < q_len
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + (base + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )
    # Keys as [HEAD_DIM_PAD, BLOCK_N] (the dot's right operand), values as [BLOCK_N, HEAD_DIM_PAD].
    k_ptrs = (
        k_ptr + base * stride_kt + kv_head * stride_kh + offs_n[None, :] * stride_kt
    ) + offs_d[:, None]
    v_ptrs = (
        v_ptr + base * stride_vt + kv_head * stride_vh + offs_n[:, None] * stride_vt
    ) + offs_d[None, :]

    # Unmasked tiles: causal, those wholly below the program's first token (every row sees
    # them whole); bidirectional, all but the request's last partial tile. Then the masked ones:
    # the diagonal up to the program's last token, or the request's tail.
    if CAUSAL:
        lo = (q_block * BLOCK_Q) // BLOCK_N * BLOCK_N
        hi = tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    else:
        lo = q_len // BLOCK_N * BLOCK_N
        hi = q_len
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    m_i, l_i, acc = _ragged_tiles(
        q, k_ptrs, v_ptrs, 0, lo, m_i, l_i, acc, offs_n, d_ok, tok, q_len, qk_scale,
        stride_kt, stride_vt, BLOCK_N, False, CAUSAL, PADDED, DOT_PRECISION, WHILE_LOOP,
    )  # fmt: skip
    m_i, l_i, acc = _ragged_tiles(
        q, k_ptrs, v_ptrs, lo, hi, m_i, l_i, acc, offs_n, d_ok, tok, q_len, qk_scale,
        stride_kt, stride_vt, BLOCK_N, True, CAUSAL, PADDED, DOT_PRECISION, WHILE_LOOP,
    )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (base + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


_ragged_prefill_launch = JitLaunch(_ragged_prefill)


def ragged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    out: torch.Tensor,  # like query
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, on the device
    num_seqs: int,
    num_tokens: int,
    scale: float,
    causal: bool = True,
    launch: RaggedLaunch | None = None,
) -> torch.Tensor:
    """Attention of each request's queries over its own keys and values, rows
    ``query_start_loc[i]:query_start_loc[i + 1]`` of ``query``, ``key`` and ``value``: causal (a
    token sees its request's tokens up to itself) or, with ``causal=False``, bidirectional (all
    of them). Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``. Writes the
    first ``num_tokens`` rows of ``out`` and returns it. The tensors may be strided views, with
    unit stride in the head dim. ``launch`` overrides :func:`default_launch` (benchmarks)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if any(t.stride(-1) != 1 for t in (query, key, value, out)):
        raise ValueError("query, key, value and out need unit stride in the head dim")
    g = num_heads // num_kv_heads
    head_dim_pad = _head_dim_pad(head_dim)
    if launch is None:
        launch = default_launch(head_dim, query.dtype, query.device, g)
    hpp = launch.heads_per_program
    if g % hpp or launch.block_m % hpp:
        raise ValueError(
            f"heads_per_program {hpp} must divide the {g} query heads of a KV head and "
            f"block_m {launch.block_m}"
        )
    if not num_tokens:
        return out
    block_q = launch.block_m // hpp
    num_q_blocks = num_tokens // block_q + num_seqs
    _ragged_prefill_launch(
        (num_q_blocks, num_heads // hpp),
        query,
        key,
        value,
        out,
        query_start_loc,
        scale * 1.4426950408889634,  # log2(e): the softmax in base 2
        *query.stride()[:2],
        *key.stride()[:2],
        *value.stride()[:2],
        *out.stride()[:2],
        num_seqs,
        num_q_blocks,
        g,
        HEADS_PER_PROGRAM=hpp,
        BLOCK_Q=block_q,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        PADDED=head_dim != head_dim_pad,
        CAUSAL=causal,
        # float32 inputs mean float32 arithmetic: no silent TF32 rounding in the dots.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        WHILE_LOOP=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out
