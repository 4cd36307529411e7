"""The experts of a mixture of experts as grouped GEMMs in Triton.

The routed pairs (token, slot) are grouped by expert, each expert's run padded to ``BLOCK_M``
rows (:func:`align_tokens_triton`, three small kernels, as
:func:`pagoda.ops.fused_moe.align_tokens` specifies). One program computes ``BLOCK_M`` rows of one
expert times ``BLOCK_N`` output columns, so each expert's weights are read once per block of
its tokens, and an expert that received no token is never read: a decode step reads only the
routed experts' weights.

- gate/up: ``x[token] @ w13[e, :I].T`` and ``@ w13[e, I:].T`` in two float32 accumulators over
  the whole hidden dimension, then ``silu(gate) * up`` rounded once, stored by pair;
- down: ``act[pair] @ w2[e].T`` accumulated over the whole intermediate dimension, times the
  pair's routing weight, stored by pair;
- the sum of each token's ``k`` pairs, in slot order, in float32.

No split of the reduction dimension, so a row's result depends only on the launch config; with
``model.batch_invariant`` one config serves every token count and the result of a token is the
same whatever batch it is in. Launch configs per GPU are in ``moe_configs/<GPU name>.json``
beside this file (written by ``benchmarks/tune_moe.py``); a shape or GPU without an entry gets
a heuristic one. Grids come from shapes alone: nothing is read back to the host, so the
operator can be captured in a CUDA graph.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch
import triton
import triton.language as tl

from pagoda.ops import batch_invariant
from pagoda.ops.fused_moe import Alignment, check_experts

CONFIG_DIR = Path(__file__).with_name("moe_configs")
_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
#: The one config of batch-invariant mode (every token count).
INVARIANT_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


# NOTE: the counts that change with the batch are not specialised on, so that one compiled
# kernel serves every batch size (the CUDA graphs of the decode buckets, the tests' sizes).
@triton.jit(do_not_specialize=["num_pairs", "top_k"])
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, top_k, hidden, inter,
    stride_xm, stride_we, stride_wn, stride_wk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_n = tl.cdiv(inter, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    row_ok = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]
    w_base = w_ptr + expert * stride_we + ks[:, None] * stride_wk
    g_ptrs = w_base + cols[None, :].to(tl.int64) * stride_wn
    u_ptrs = w_base + (cols[None, :] + inter).to(tl.int64) * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_ok = ks < hidden - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc_g += tl.dot(a, g, input_precision="ieee")
            acc_u += tl.dot(a, u, input_precision="ieee")
        else:
            acc_g += tl.dot(a, g)
            acc_u += tl.dot(a, u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    a_ptr, w_ptr, out_ptr, weight_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, inter, hidden,
    stride_am, stride_we, stride_wn, stride_wk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_n = tl.cdiv(hidden, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    row_ok = pair < num_pairs
    pair64 = pair.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + pair64[:, None] * stride_am + ks[None, :]
    w_ptrs = (w_ptr + expert * stride_we + ks[:, None] * stride_wk
              + cols[None, :].to(tl.int64) * stride_wn)  # fmt: skip
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(inter, BLOCK_K)):
        k_ok = ks < inter - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    weight = tl.load(weight_ptr + pair64, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + pair64[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["top_k"])
def _sum_slots_kernel(
    pairs_ptr, ids_ptr, out_ptr, top_k, hidden, BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, top_k):  # slot order: fixed
        expert = tl.load(ids_ptr + token * top_k + j)
        routed = ok & ((tl.zeros_like(cols) + expert) >= 0)
        row = tl.load(pairs_ptr + (token * top_k + j) * hidden + cols, mask=routed, other=0.0)
        total += row.to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    routed = (offs < num_pairs) & (expert >= 0) & (expert < num_experts)
    one = tl.full((BLOCK,), 1, tl.int32)
    tl.atomic_add(counts_ptr + tl.where(routed, expert, 0), one, mask=routed)


@triton.jit(do_not_specialize=["num_blocks"])
def _offsets_kernel(
    counts_ptr, cursor_ptr, block_expert_ptr, num_padded_ptr, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    es = tl.arange(0, E_POW2)
    real = es < num_experts
    counts = tl.load(counts_ptr + es, mask=real, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + es, ends - padded, mask=real)
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        rows = blocks * BLOCK_M
        # A block's expert: how many experts' padded runs end at or before its first row.
        ended = (ends[None, :] <= rows[:, None]) & real[None, :]
        expert = tl.sum(ended.to(tl.int32), axis=1)
        expert = tl.where(rows < total, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _place_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_pairs, num_experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    routed = (offs < num_pairs) & (expert >= 0) & (expert < num_experts)
    one = tl.full((BLOCK,), 1, tl.int32)
    place = tl.atomic_add(cursor_ptr + tl.where(routed, expert, 0), one, mask=routed)
    tl.store(sorted_ptr + place, offs.to(tl.int32), mask=routed)


_ALIGN_BLOCK = 1024
#: The offsets kernel holds every expert's count in one program.
MAX_EXPERTS = 1024


def align_tokens_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """:func:`pagoda.ops.fused_moe.align_tokens` in three small kernels (count, offsets,
    place) instead of some forty torch operations: a decode step runs it once per MoE layer.
    The pairs of one expert come in any order (each row's result is its own)."""
    if not 0 < num_experts <= MAX_EXPERTS:
        raise ValueError(f"fused MoE: {num_experts} experts; the kernels group 1 to "
                         f"{MAX_EXPERTS}")  # fmt: skip
    ids = topk_ids.reshape(-1)
    ids = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32)
    pairs, device = ids.numel(), ids.device
    blocks = max(triton.cdiv(pairs + num_experts * (block_m - 1), block_m), 1)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_pairs = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=device)
    block_experts = torch.empty(blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    grid = (max(triton.cdiv(pairs, _ALIGN_BLOCK), 1),)
    _count_kernel[grid](ids, counts, pairs, num_experts, BLOCK=_ALIGN_BLOCK)
    _offsets_kernel[(1,)](
        counts, cursor, block_experts, num_padded, num_experts, blocks,
        BLOCK_M=block_m, E_POW2=triton.next_power_of_2(num_experts), BLOCK_B=64,
    )  # fmt: skip
    _place_kernel[grid](ids, cursor, sorted_pairs, pairs, num_experts, BLOCK=_ALIGN_BLOCK)
    return Alignment(sorted_pairs, block_experts, num_padded, block_m)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"


def config_key(num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype) -> str:
    """The key of a shape in a GPU's config file."""
    return f"E={num_experts},I={inter},H={hidden},k={top_k},dtype={str(dtype).split('.')[-1]}"


@cache
def _tuned(device_name: str) -> dict[str, dict[int, dict[str, int]]]:
    path = CONFIG_DIR / f"{device_name}.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {shape: {int(m): c for m, c in by_m.items()} for shape, by_m in data.items()}


def heuristic_config(num_tokens: int, top_k: int, num_experts: int) -> dict[str, int]:
    """A config for a shape with no tuned entry: small row blocks while each expert gets few
    rows (decode), larger ones when the experts are full."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    if per_expert <= 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def pick_config(
    num_tokens: int, w13: torch.Tensor, top_k: int, dtype: torch.dtype
) -> dict[str, int]:
    """The launch config for ``num_tokens`` tokens: the fixed one in batch-invariant mode, else
    the tuned entry of the nearest token count for this GPU and shape, else the heuristic."""
    if batch_invariant._enabled:
        return INVARIANT_CONFIG
    experts, two_inter, hidden = w13.shape
    by_m = _tuned(_device_name(w13.device)).get(
        config_key(experts, two_inter // 2, hidden, top_k, dtype)
    )
    if by_m:
        return by_m[min(by_m, key=lambda m: abs(m - num_tokens))]
    return heuristic_config(num_tokens, top_k, experts)


def fused_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """:class:`pagoda.ops.fused_moe.FusedExperts` in three kernels (see the module)."""
    check_experts(x, w13, w2, topk_ids)
    n, top_k = topk_ids.shape
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    out = torch.empty_like(x)
    if n == 0:
        return out
    cfg = config or pick_config(n, w13, top_k, x.dtype)
    if set(cfg) != set(_KEYS):
        raise ValueError(f"fused MoE launch config needs exactly {_KEYS}, got {sorted(cfg)}")
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    align = align_tokens_triton(topk_ids, experts, bm)
    pairs = n * top_k
    blocks = align.block_experts.shape[0]
    ieee = x.dtype == torch.float32
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks * triton.cdiv(inter, bn),)](
        x, w13, act, align.sorted_pairs, align.block_experts, align.num_padded,
        pairs, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee, **opts,
    )  # fmt: skip
    by_pair = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32)
    _down_kernel[(blocks * triton.cdiv(hidden, bn),)](
        act, w2, by_pair, weights, align.sorted_pairs, align.block_experts, align.num_padded,
        pairs, inter, hidden,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), by_pair.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee, **opts,
    )  # fmt: skip
    block = min(1024, triton.next_power_of_2(hidden))
    ids = topk_ids.to(torch.int32).contiguous()
    _sum_slots_kernel[(n, triton.cdiv(hidden, block))](
        by_pair, ids, out, top_k, hidden, BLOCK=block, num_warps=4
    )
    return out
