"""The gate/up projection and SiLU-and-mul of a gated MLP in one Triton GEMM (Hopper, TMA).

Unfused, a prefill step's MLP writes the gate/up projection ``[tokens, 2 * I]`` and reads it back
for ``silu(gate) * up``: on an H200 at 32,768 tokens of Qwen3-0.6B (hidden 1,024, I = 3,072),
cuBLAS took 555 us and the SiLU kernel 146. Here each program computes a tile of the gate's
columns and the same tile of the up's (two accumulators over the same rows of ``x``) and stores
``silu(gate) * up`` alone: 654 us for both. The tile's gate and up rows of the weight are loaded
through one tensor descriptor (``[2 * I, K]``: the up rows ``I`` below the gate's).

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

# (block_m, block_n, block_k, group_m, stages, warps): the fastest of a sweep on an H200 at
# 32,768 x 1,024 x 2 * 3,072, bf16 (block_n columns of the gate and as many of the up a program).
LAUNCH = (128, 64, 64, 8, 3, 8)
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DTYPE: tl.constexpr,
):
    # Programs in groups of GROUP_M row tiles, column tile by column tile: a group's rows of x
    # and the weight's column tiles stay in L2 while they are read again.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // group) * GROUP_M
    rows = min(num_m - first_m, GROUP_M)
    m0 = (first_m + (pid % group) % rows) * BLOCK_M
    n0 = ((pid % group) // rows) * BLOCK_N
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([m0, k])
        gate = tl.dot(x, w_desc.load([n0, k]).T, gate)
        up = tl.dot(x, w_desc.load([N + n0, k]).T, up)
    out = gate / (1.0 + tl.exp(-gate)) * up
    # (rows past M are dropped by the descriptor)
    out_desc.store([m0, n0], out.to(DTYPE))


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes ``x`` [M, K] and ``weight`` [2 * I, K]: bf16 or fp16 on a Hopper
    device, both contiguous and 16-byte aligned (the descriptors' rule), K and I multiples of the
    tiles."""
    block_m, block_n, block_k = LAUNCH[:3]
    return (
        x.is_cuda
        and x.dim() == 2
        and weight.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.device == x.device
        and torch.cuda.get_device_capability(x.device)[0] == 9
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % block_k == 0
        and weight.shape[0] % (2 * block_n) == 0
    )


def gate_up_silu_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for ``weight`` = ``[gate; up]`` ([2 * I, K]): [M, I].
    The caller checks :func:`supported`."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m, block_n, block_k, group_m, stages, warps = LAUNCH
    m, k = x.shape
    n = weight.shape[0] // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gate_up_silu_kernel[grid](
        TensorDescriptor.from_tensor(x, [block_m, block_k]),
        TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]),
        m,
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        DTYPE=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16,
        num_stages=stages,
        num_warps=warps,
    )
    return out
