"""The gate/up projection and SiLU-and-mul of a gated MLP in one Triton GEMM (Hopper, TMA).

Unfused, a prefill step's MLP writes the gate/up projection ``[tokens, 2 * I]`` and reads it back
for ``silu(gate) * up``: on an H200 at 32,768 tokens of Qwen3-0.6B (hidden 1,024, I = 3,072),
cuBLAS took 558 us and the SiLU kernel 188 (each with L2 flushed between runs). Here each program
computes a tile of the gate's columns and the same tile of the up's as one dot and stores
``silu(gate) * up`` alone: 626 us for both. The tile's gate and up rows of the weight are loaded
together through one three-dimensional tensor descriptor over the weight seen as ``[2, I, K]``
(block ``[2, BLOCK_N, BLOCK_K]``, as ``[2 * BLOCK_N, BLOCK_K]`` to the dot), so the checkpoint's
``[gate; up]`` layout stays as it is for the unfused path.

SiLU is taken on the fp32 accumulators, before any rounding: the unfused path rounds the gate and
the up to the activation's dtype first, so the two differ by that rounding (the fused one is the
closer to exact arithmetic).

Small steps (decode, short prompts) stay on cuBLAS: at a few hundred rows its kernels for small
problems win, and :func:`pagoda.ops.gate_up_silu` only takes steps of ``MIN_ROWS`` rows or more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.ops.triton_gemm_common import column_halves, grouped_tile, num_sms, tma_gemm_operands

# (block_m, block_n, block_k, group_m, stages, warps): the fastest of a sweep on an H200 at
# 32,768 x 1,024 x 2 * 3,072, bf16 (block_n columns of the gate and as many of the up a program;
# 626 us, against 684 for the best launch of a program a tile, at 128 x 2 x 64).
LAUNCH = (128, 128, 64, 8, 3, 8)
# Fewer rows run the projection and silu_and_mul apart (8,192 rows gained 17 us of 199 on the H200).
MIN_ROWS = 4096


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_kernel(
    x_desc,
    w_desc,
    out_desc,
    M,
    N,
    K,
    programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DTYPE: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, programs, flatten=True):
        m0, n_tile = grouped_tile(tile, num_m, num_n, BLOCK_M, GROUP_M)
        n0 = n_tile * BLOCK_N
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32)
        for k in range(0, K, BLOCK_K):
            w = w_desc.load([0, n0, k]).reshape(2 * BLOCK_N, BLOCK_K)  # the gate's rows, the up's
            acc = tl.dot(x_desc.load([m0, k]), w.T, acc)
        gate, up = column_halves(acc, BLOCK_M, 1, BLOCK_N)
        out = tl.reshape(gate / (1.0 + tl.exp(-gate)) * up, (BLOCK_M, BLOCK_N))
        # (rows past M are dropped by the descriptor)
        out_desc.store([m0, n0], out.to(DTYPE))


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes ``x`` [M, K] and ``weight`` [2 * I, K]: operands its tensor
    descriptors load (:func:`tma_gemm_operands`), I a multiple of the tile."""
    block_n, block_k = LAUNCH[1:3]
    return tma_gemm_operands(x, weight, block_k) and weight.shape[0] % (2 * block_n) == 0


def gate_up_silu_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    launch: tuple[int, int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for ``weight`` = ``[gate; up]`` ([2 * I, K]): [M, I].
    The caller checks :func:`supported` (with ``launch``: its block_n and block_k too)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m, block_n, block_k, group_m, stages, warps = launch or LAUNCH
    m, k = x.shape
    n = weight.shape[0] // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    programs = min(num_sms(x.device), triton.cdiv(m, block_m) * triton.cdiv(n, block_n))
    _gate_up_silu_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]),
        TensorDescriptor(weight.view(2, n, k), [2, n, k], [n * k, k, 1], [2, block_n, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]),
        m,
        n,
        k,
        programs,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        DTYPE=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16,
        num_stages=stages,
        num_warps=warps,
    )
    return out
