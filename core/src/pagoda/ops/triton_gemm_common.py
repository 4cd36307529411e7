"""What the Hopper GEMMs with fused epilogues (:mod:`pagoda.ops.triton_gated_gemm`,
:mod:`pagoda.ops.triton_qkv_norm_rotary`) share: the operands their tensor descriptors load, and
the order their programs take the output's tiles in."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def grouped_tile(M, num_n, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (first row, column tile index) of an [M, num_n tiles] output: programs in
    groups of GROUP_M row tiles, column tile by column tile, so that a group's rows of x and the
    weight's column tiles stay in L2 while they are read again."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    rows = min(num_m - first_m, GROUP_M)
    return (first_m + (pid % group) % rows) * BLOCK_M, (pid % group) // rows


def tma_gemm_operands(x: torch.Tensor, weight: torch.Tensor, block_k: int) -> bool:
    """``x`` [M, K] and ``weight`` [N, K]: bf16 or fp16 on one Hopper device, both contiguous and
    16-byte aligned (the descriptors' rule), K a multiple of ``block_k``."""
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
    )


@triton.jit
def two_column_tiles(x_desc, w_desc, m0, n_a, n_b, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):  # fmt: skip
    """``x[m0:m0 + BLOCK_M] @ w[n:n + BLOCK_N].T`` for ``n`` = ``n_a`` and ``n_b``, in float32:
    the two accumulators an epilogue combines (a gate's and an up's columns, a head's halves),
    each row tile of x loaded once for both."""
    a = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    b = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([m0, k])
        a = tl.dot(x, w_desc.load([n_a, k]).T, a)
        b = tl.dot(x, w_desc.load([n_b, k]).T, b)
    return a, b
