"""Per-token FP8 quantization in one Triton kernel: each row's ``amax``, its scale (``amax *
(1 / 448)``, at least ``MIN_SCALE``: :func:`pagoda.ops.fp8_format.scale_of`'s float32 product,
the same bits) and the clamped cast, where the torch code
(:func:`pagoda.ops.fp8_format.quantize_rows`) takes five kernels and two float32 copies of a row.

A program holds one row whole (rows up to 16384 values: every hidden and intermediate size of
the models served), so the row is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.ops.fp8_format import FP8_DTYPE, FP8_INV_MAX, FP8_MAX, MIN_SCALE, quantize_rows
from pagoda.ops.launch import JitLaunch

_MAX_ROW = 16384


@triton.jit
def _quantize_rows(
    x_ptr,
    q_ptr,
    scale_ptr,
    cols,
    stride_x,
    fp8_max,
    inv_max,
    min_scale,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) * inv_max, min_scale)
    q = tl.clamp(x / scale, -fp8_max, fp8_max)
    tl.store(q_ptr + row * cols + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


_quantize_rows_launch = JitLaunch(_quantize_rows)


def quantize_tokens_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (unit stride in K) -> (FP8 [M, K] contiguous, float32 scales [M, 1])."""
    m, k = x.shape
    if k > _MAX_ROW or x.stride(-1) != 1:
        return quantize_rows(x)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quantize_rows_launch((m,), 
            x, q, scale, k, x.stride(0), FP8_MAX, FP8_INV_MAX, MIN_SCALE,
            BLOCK=block, num_warps=4 if block <= 4096 else 8,
        )  # fmt: skip
    return q, scale
