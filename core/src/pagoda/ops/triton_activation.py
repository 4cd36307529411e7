"""SiLU and multiply in Triton: the MLP's [tokens, 2 * I] gate/up projection to [tokens, I] in one
pass, without the two intermediates of the torch code.

Rounding follows :func:`pagoda.ops.reference.silu_and_mul`: ``silu(gate)`` is computed in float32
and rounded to the input dtype, then multiplied by ``up`` in float32 and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.ops.launch import JitLaunch

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + t * stride_x
    gate = tl.load(row + cols, mask=mask).to(tl.float32)
    up = tl.load(row + inter + cols, mask=mask).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


_silu_and_mul_kernel_launch = JitLaunch(_silu_and_mul_kernel)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0 and inter > 0:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel_launch(
            (rows.shape[0], triton.cdiv(inter, block)),
            rows,
            out,
            inter,
            rows.stride(0),
            inter,
            BLOCK=block,
            num_warps=4,
        )
    return out
