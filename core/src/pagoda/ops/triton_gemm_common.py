"""What the Hopper GEMMs with fused epilogues (:mod:`pagoda.ops.triton_gated_gemm`,
:mod:`pagoda.ops.triton_qkv_norm_rotary`) share: the operands their tensor descriptors load, the
order their programs take the output's tiles in, and how an epilogue takes an accumulator's
column pairs apart.

Both kernels compute their tile as one dot of ``2 * n`` columns (a gate's and an up's, a head's
two halves) and split the float32 accumulator in the epilogue. Two dots of ``n`` columns sharing
the rows of x, as they first did, issue Hopper's tensor-core instructions at half the width, which
read their operands from shared memory twice as often per product: on an H200 the single dot took
the gate/up GEMM with SiLU at 32,768 x 1,024 x 2 x 3,072 from 737 us to 680, and Qwen3-0.6B's qkv
projection with norms and rotation from 601 to 506.

The gate/up GEMM is persistent: one program a multiprocessor, taking the tiles ``num_sms``
apart, with the loop over tiles and the loop over K flattened into one (``tl.range(...,
flatten=True)``), so that the loads of a program's next tile are issued while it runs this
one's epilogue: with K = 1,024 a tile's main loop is only 16 steps, and a program a tile left
the pipeline to fill again after every epilogue (626 us persistent against 676 a program a tile,
at 128 x 2 x 128 a tile). The qkv kernel is persistent too, at 128 x 256 tiles (two heads) on 8
warps, but its tile loop is not flattened: with its epilogue's branch on the head's kind the
flattened loop either needs more shared memory than a block has or, under Triton 3.6, does not
compile."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile, num_m, num_n, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile ``tile``'s (first row, column tile index) of an [num_m, num_n] grid of tiles: tiles in
    groups of GROUP_M row tiles, column tile by column tile, so that a group's rows of x and the
    weight's column tiles stay in L2 while they are read again."""
    group = GROUP_M * num_n
    first_m = (tile // group) * GROUP_M
    rows = min(num_m - first_m, GROUP_M)
    return (first_m + (tile % group) % rows) * BLOCK_M, (tile % group) // rows


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's multiprocessors: the programs of a persistent kernel, one each (two under
    Triton's interpreter on a CPU, so that its tests give a program several tiles)."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


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
def column_halves(acc, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, HALF: tl.constexpr):
    """``acc`` [BLOCK_M, GROUPS * 2 * HALF] as GROUPS groups of two halves of HALF columns: the
    first halves and the second ([BLOCK_M, GROUPS, HALF] each). Bits moved, no arithmetic."""
    pairs = tl.permute(tl.reshape(acc, (BLOCK_M, GROUPS, 2, HALF)), (0, 1, 3, 2))
    return tl.split(pairs)


@triton.jit
def join_halves(a, b, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, HALF: tl.constexpr):
    """The inverse of :func:`column_halves`: [BLOCK_M, GROUPS * 2 * HALF]."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 1, 3, 2)), (BLOCK_M, GROUPS * 2 * HALF))
