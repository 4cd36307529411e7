"""Qwen3's qkv projection with its per-head RMSNorm of q and k and their rotary embedding in the
GEMM's epilogue, in one Triton kernel (Hopper, TMA).

Unfused, a prefill step writes the projection ``[tokens, (H + 2 * KV) * D]``, then
:func:`pagoda.ops.qk_norm_rotary` reads q and k back and writes them again: on an H200 at
32,768 tokens of Qwen3-0.6B the projection took 405 us (cuBLAS) and the norm-and-rotation kernel
118. Here a program computes the columns of one or two heads (:func:`heads_per_tile`) for
``BLOCK_M`` rows as one dot, takes each head's first half and second (the two operands of the
neox rotation) apart in registers, and normalises and rotates q and k heads before they are
stored; v heads are stored as computed. Given the layer's KV cache, the programs of k and v heads
also store their tile in its rows' slots (scattered rows: blocks need not be in order), so that
the layer's cache write, which would read them back, is skipped: at 32,768 rows the stores add 41
us to the kernel, and the write took 73.

The arithmetic after the dot is the separate kernels': the projection's value rounded to the
activation's dtype, each row's sum of squares in float32, the normalised value rounded, times
the weight, rounded again, then each rotation product rounded on its own (``mul_rn``). Only the
order of the sum of squares (two halves, then their sum) and the GEMM's own accumulation order
differ from the unfused path, so results agree within those roundings, not bit for bit.

Checked against float64 by ``tests/unit/test_fused_gemm_epilogues.py`` (Triton's interpreter,
float16) and ``tests/gpu/test_fused_ops_gpu.py`` (bfloat16, Qwen3-0.6B's heads). The kernel is
persistent (one program a multiprocessor takes tiles in turn) at two heads a tile on two warp
groups: at the H200's power limit that costs about 4% less energy a call than a program a tile
of one head on one warp group, the default before, and runs an embedding call 2.3% faster (the
figures are at :data:`LAUNCH`). Its tile loop is not flattened into the K loop, as the gate/up
kernel's is: with this epilogue the flattened loop needs more shared memory than a Hopper block
has (278 KB).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagoda.ops.launch import JitLaunch
from pagoda.ops.triton_gemm_common import (
    column_halves,
    grouped_tile,
    join_halves,
    num_sms,
    tma_gemm_operands,
)
from pagoda.ops.triton_qk_norm_rotary import _mul  # products rounded as the separate kernel's

# Set to False to run the projection and the norms apart (``ops.qkv_norm_rotary`` then returns
# None).
ENABLED = True
# (block_m, block_k, group_m, stages, warps), and heads a tile (where two fit: heads_per_tile).
# The kernel is persistent: one program a multiprocessor, each taking tiles in turn. On an H200 at
# Qwen3-0.6B's 32,768 x 1,024 x 32 heads of 128, bf16, each launch alone at the board's 700 W
# limit (energy from NVML, a call's share; cuBLAS's projection alone 325 mJ):
#   a program a tile, 128 x 128 (one head) on 4 warps, 2 stages (the default before): 421 mJ
#   persistent, 128 x 256 (two heads) on 8 warps, 3 stages, row groups of 8 / 16: 404 / 401 mJ
#   the same, 2 stages: 456; 128 x 128 on 4 warps, two programs a multiprocessor: 484
#   a program a tile, 128 x 256 on 8 warps (3 stages): 409; 64 x 256 on 4 warps: 452 - 495
# and embedding calls of 256 x 512 tokens, interleaved in one engine at the limit: 235.4 ms
# (median of 8) persistent at two heads against 240.8 a program a tile at one.
# (Plain GEMMs of the same tiles, the epilogue only storing: 370 mJ at 128 x 128 on 4 warps,
# 340 at 128 x 256 on 8 warps, persistent; the norms and rotation add about 36 mJ to the
# latter, the KV store 28.) Judged earlier at a program a tile: 2 stages ran the call 2.3%
# faster than 3 at one head on 4 warps, and 128-column K steps 9.7% slower.
LAUNCH = (128, 64, 16, 3, 8)
HEADS_PER_PROGRAM = 2
# False: a program a tile (the kernel before it was persistent; its loop then runs once).
PERSISTENT = True
MIN_ROWS = 4096
# A cache plane of this many elements or more is addressed with 64-bit offsets a row.
WIDE_PLANE = 2**31


@triton.jit
def _store_kv(tile, m0, kv_head, M, kv_heads, cache_ptr, slot_ptr, plane, BLOCK_M: tl.constexpr,
              COLS: tl.constexpr, D: tl.constexpr, WIDE: tl.constexpr,
              ALIGNED: tl.constexpr):  # fmt: skip
    """A tile of keys (``kv_head`` below ``kv_heads``) or values (from ``kv_heads`` on), its
    first column head ``kv_head``'s, stored in its rows' slots of the cache (``[2, slots,
    kv_heads, D]``, ``plane`` elements apart); a slot below zero writes nothing. A row's offset
    in its plane is 32-bit unless ``WIDE`` (a plane of 2**31 elements or more): compiled for
    sm_90 by Triton 3.9, 64-bit offsets of a tile's elements held the kernel at the register
    file's limit and spilled (255 registers and 956 bytes of spills a thread, against 250 and
    none); Triton 3.6 gives it 168 registers and no spills either way, and on an H200 with it
    embedding calls took the same time with both (medians 240.6 and 239.7 ms)."""
    kind = kv_head // kv_heads  # 0: keys, 1: values
    rows = m0 + tl.arange(0, BLOCK_M)
    slot = tl.load(slot_ptr + rows, mask=rows < M, other=-1)
    if WIDE:
        slot = slot.to(tl.int64)
    else:
        slot = slot.to(tl.int32)
    cols = tl.arange(0, COLS)
    base = cache_ptr + kind.to(tl.int64) * plane + (kv_head - kind * kv_heads) * D
    if ALIGNED:
        # (Without it the compiler cannot tell a head's row starts 16 bytes aligned, and stores
        # the tile an element at a time: 256 stores a thread where 32 of 16 bytes do.)
        base = tl.multiple_of(base, 16)
    tl.store(base + (slot * (kv_heads * D))[:, None] + cols[None, :], tile,
             mask=(slot >= 0)[:, None])  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _qkv_norm_rotary_kernel(
    x_desc,
    w_desc,
    out_desc,
    pos_ptr,
    wq_ptr,
    wk_ptr,
    cos_ptr,
    sin_ptr,
    stride_cos,
    M,
    K,
    q_heads,
    k_heads,
    heads,
    eps,
    cache_ptr,
    slot_ptr,
    plane,
    programs,
    BLOCK_M: tl.constexpr,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DTYPE: tl.constexpr,
    EXACT: tl.constexpr,
    STORE_KV: tl.constexpr,
    WIDE: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # HEADS heads' columns a tile, all of q, all of k or all of v (the caller's rule); each
    # program takes every ``programs``-th tile. (Not flattened into one loop with the K steps:
    # the next tile's loads would then be issued during this one's epilogue, but the pipeline's
    # buffers and the epilogue's no longer share shared memory: 278 KB at the default launch.)
    num_m = tl.cdiv(M, BLOCK_M)
    tiles_n = heads // HEADS
    for t in tl.range(tl.program_id(0), num_m * tiles_n, programs):
        m0, tile = grouped_tile(t, num_m, tiles_n, BLOCK_M, GROUP_M)
        head = tile * HEADS
        n0 = head * 2 * HALF
        acc = tl.zeros((BLOCK_M, HEADS * 2 * HALF), tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(x_desc.load([m0, k]), w_desc.load([n0, k]).T, acc)
        if head < q_heads + k_heads:
            # Each head's two halves (the neox rotation's operands) as projected and rounded as
            # the unfused path stores them, then the norm kernel's steps, per head.
            a1, a2 = column_halves(acc, BLOCK_M, HEADS, HALF)
            x1 = a1.to(DTYPE).to(tl.float32)
            x2 = a2.to(DTYPE).to(tl.float32)
            sq = tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)
            inv = tl.math.rsqrt(sq / (2 * HALF) + eps)
            if head < q_heads:
                w_ptr = wq_ptr
            else:
                w_ptr = wk_ptr
            d = tl.arange(0, HALF)
            w1 = tl.load(w_ptr + d).to(tl.float32)[None, None, :]
            w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, None, :]
            y1 = (w1 * (x1 * inv[:, :, None]).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
            y2 = (w2 * (x2 * inv[:, :, None]).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
            rows = m0 + tl.arange(0, BLOCK_M)
            pos = tl.load(pos_ptr + rows, mask=rows < M, other=0).to(tl.int64)[:, None, None]
            cos = tl.load(cos_ptr + pos * stride_cos + d[None, None, :])
            sin = tl.load(sin_ptr + pos * stride_cos + d[None, None, :])
            o1 = _mul(y1, cos, EXACT) - _mul(y2, sin, EXACT)
            o2 = _mul(y2, cos, EXACT) + _mul(y1, sin, EXACT)
            # (rows past M are dropped by the descriptor)
            out = join_halves(o1, o2, BLOCK_M, HEADS, HALF).to(DTYPE)
            out_desc.store([m0, n0], out)
            if STORE_KV and head >= q_heads:
                _store_kv(out, m0, head - q_heads, M, k_heads, cache_ptr, slot_ptr, plane,
                          BLOCK_M, HEADS * 2 * HALF, 2 * HALF, WIDE, ALIGNED)  # fmt: skip
        else:
            out = acc.to(DTYPE)
            out_desc.store([m0, n0], out)
            if STORE_KV:
                _store_kv(out, m0, head - q_heads, M, k_heads, cache_ptr, slot_ptr, plane,
                          BLOCK_M, HEADS * 2 * HALF, 2 * HALF, WIDE, ALIGNED)  # fmt: skip


_qkv_norm_rotary_kernel_launch = JitLaunch(_qkv_norm_rotary_kernel)


def heads_per_tile(q_heads: int, kv_heads: int, head_dim: int, preferred: int | None = None) -> int:
    """Heads a tile holds: ``preferred`` (1 or 2; None: :data:`HEADS_PER_PROGRAM` as it is at
    the call); two only where pairs never straddle q's, k's and v's heads and two heads fit a
    descriptor's box (256 columns), else one."""
    if preferred is None:
        preferred = HEADS_PER_PROGRAM
    if preferred not in (1, 2):
        raise ValueError(f"heads a program: 1 or 2, not {preferred}")
    fits = q_heads % 2 == 0 and kv_heads % 2 == 0 and head_dim <= 128
    return 2 if preferred == 2 and fits else 1


def supported(x: torch.Tensor, weight: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel takes ``x`` [M, K] and ``weight`` [heads * head_dim, K]: operands its
    tensor descriptors load (:func:`tma_gemm_operands`), heads of a power of two from 32 to
    256."""
    return (
        tma_gemm_operands(x, weight, LAUNCH[1])
        and head_dim in (32, 64, 128, 256)
        and weight.shape[0] % head_dim == 0
    )


def qkv_norm_rotary_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    launch: tuple[int, int, int, int, int] | None = None,
    kv_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    heads_per_program: int | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` ([M, (q_heads + 2 * kv_heads) * head_dim]: q's heads, k's, v's) with each
    q and k head normalised (``q_weight``, ``k_weight``: [head_dim]) then rotated at
    ``positions`` (``cos``/``sin``: [max_position, head_dim // 2], float32, rows of one stride).
    With ``kv_cache`` (``[2, num_blocks, block_size, kv_heads, head_dim]``, contiguous, ``x``'s
    dtype), each row's key and value heads are also stored in its slot, ``slot_mapping[row]``
    (int64, M of them; below zero: none), as :func:`pagoda.attention.backend.write_kv_cache`
    stores them. ``launch`` and ``heads_per_program`` (:func:`heads_per_tile`'s preference):
    the defaults, :data:`LAUNCH` and :data:`HEADS_PER_PROGRAM`, unless a sweep says. The caller
    checks :func:`supported`."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m, block_k, group_m, stages, warps = launch or LAUNCH
    m, k = x.shape
    heads = q_heads + 2 * kv_heads
    if weight.shape[0] != heads * head_dim:
        raise ValueError(
            f"weight has {weight.shape[0]} rows; {heads} heads of {head_dim} need "
            f"{heads * head_dim}"
        )
    per_tile = heads_per_tile(q_heads, kv_heads, head_dim, heads_per_program)
    store = kv_cache is not None
    if store and (
        kv_cache.dtype != x.dtype
        or not kv_cache.is_contiguous()
        or kv_cache.shape[0] != 2
        or kv_cache.shape[-2:] != (kv_heads, head_dim)
        or slot_mapping is None
        or slot_mapping.shape[0] < m
    ):
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype}: the kernel stores into a "
            f"contiguous [2, blocks, block_size, {kv_heads}, {head_dim}] cache of {x.dtype}, "
            f"with a slot for each of the {m} rows"
        )
    out = torch.empty(m, heads * head_dim, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, block_m) * (heads // per_tile)
    programs = min(num_sms(x.device), tiles) if PERSISTENT else tiles
    _qkv_norm_rotary_kernel_launch(
        (programs,),
        TensorDescriptor.from_tensor(x, [block_m, block_k]),
        TensorDescriptor.from_tensor(weight, [per_tile * head_dim, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, per_tile * head_dim]),
        positions,
        q_weight,
        k_weight,
        cos,
        sin,
        cos.stride(0),
        m,
        k,
        q_heads,
        kv_heads,
        heads,
        eps,
        kv_cache if store else out,
        slot_mapping if store else positions,
        kv_cache[0].numel() if store else 0,
        programs,
        BLOCK_M=block_m,
        HEADS=per_tile,
        HALF=head_dim // 2,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        DTYPE=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16,
        # NOTE: mul_rn is the device's; the interpreter's products are never fused anyway.
        EXACT=os.environ.get("TRITON_INTERPRET") != "1",
        STORE_KV=store,
        WIDE=store and kv_cache[0].numel() >= WIDE_PLANE,
        # each head's row in the cache starts 16 bytes aligned
        ALIGNED=store and kv_cache.data_ptr() % 16 == 0 and head_dim * x.element_size() % 16 == 0,
        num_stages=stages,
        num_warps=warps,
    )
    return out
