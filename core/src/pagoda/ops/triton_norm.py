"""RMSNorm in Triton, with the residual add fused in: one read of ``x`` and ``residual``, one write
of the output and of the new residual.

Rows are normalised whole: a program holds ``BLOCK_M`` rows of ``BLOCK_N`` (the row length rounded
up to a power of two) columns, several rows at once when rows are short (Qwen3's per-head q/k
norm). Rounding follows :func:`pagoda.ops.reference.rms_norm`: the sum is rounded to the input
dtype, the normalised value is rounded to it before the weight multiplies it.

For an FP8 linear that reads the output (:func:`rms_norm_fp8_triton`), the kernel stores it
quantized a row at a time instead: the rounded output's FP8 values and per-row scales, as
:mod:`pagoda.ops.triton_fp8` would compute them from the stored output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.ops.fp8 import QuantizedRows
from pagoda.ops.fp8_format import FP8_DTYPE, FP8_INV_MAX, FP8_MAX, MIN_SCALE
from pagoda.ops.launch import JitLaunch

# Elements a program normalises at once when rows are short.
_TILE = 2048


@triton.jit
def _normalize_rows(x, w, n, eps):
    """``w * rmsnorm(x)`` of a tile ``x`` of whole rows (input dtype) with the float32 weight row
    ``w``, in float32 (the caller rounds it to the output dtype): the arithmetic the norm kernels
    share, so that a row normalises to the same bits in each of them when the tile has the same
    shape and warps (:mod:`pagoda.ops.triton_qk_norm_rotary` relies on it)."""
    xf = x.to(tl.float32)
    inv = _inv_rms(xf, n, eps)
    y = (xf * inv[:, None]).to(x.dtype).to(tl.float32)
    return w[None, :] * y


@triton.jit
def _inv_rms(xf, n, eps):
    """``1 / rms`` of each row of the float32 tile ``xf`` (rows of ``n`` values, padding zero): the
    sum of squares of :func:`_normalize_rows`, in its order for a tile of its shape and warps."""
    return tl.math.rsqrt(tl.sum(xf * xf, axis=1) / n + eps)


def launch_shape(n: int, num_rows: int, fixed_tiling: bool = False) -> tuple[int, int, int]:
    """(rows a program holds, the padded row length, warps) for ``num_rows`` rows of ``n``."""
    block_n = triton.next_power_of_2(n)
    block_m = max(_TILE // block_n, 1)
    if not fixed_tiling:
        block_m = min(block_m, triton.next_power_of_2(num_rows))
    return block_m, block_n, min(max(block_m * block_n // 256, 1), 8)


# NOTE: the row count changes with every step's token count: one variant for all of them.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    scale_ptr,
    num_rows,
    heads,
    n,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_rh,
    eps,
    fp8_max,
    inv_max,
    min_scale,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr = False,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    # A row is (token, head); plain 2-D inputs have one head.
    t = (rows // heads).to(tl.int64)
    h = rows % heads
    x = tl.load(x_ptr + (t * stride_xt + h * stride_xh)[:, None] + cols[None, :], mask=mask)
    dense = rows.to(tl.int64)[:, None] * n + cols[None, :]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + (t * stride_rt + h * stride_rh)[:, None] + cols[None, :], mask=mask)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + dense, x, mask=mask)
    w = tl.load(w_ptr + cols, mask=col_ok).to(tl.float32)
    y = _normalize_rows(x, w, n, eps)
    if QUANT:
        # The output rounded to the dtype it would be stored in, then quantized a row at a
        # time exactly as pagoda.ops.triton_fp8's kernel quantizes a stored row.
        y = tl.where(mask, y.to(x.dtype).to(tl.float32), 0.0)
        scale = tl.maximum(tl.max(tl.abs(y), 1) * inv_max, min_scale)
        y = tl.clamp(y / scale[:, None], -fp8_max, fp8_max)
        tl.store(scale_ptr + rows, scale, mask=rows < num_rows)
    tl.store(out_ptr + dense, y.to(out_ptr.dtype.element_ty), mask=mask)


_rms_norm_kernel_launch = JitLaunch(_rms_norm_kernel)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A [tokens, hidden] or [tokens, heads, dim] tensor with unit stride in its last dimension,
    and its token and head strides."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:
        return t, t.stride(0), 0
    if t.dim() == 3:
        return t, t.stride(0), t.stride(1)
    raise ValueError(f"rms_norm takes a 2-D or 3-D tensor, got shape {tuple(t.shape)}")


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    fixed_tiling: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``fixed_tiling``: rows per program and warps from the row length alone, never from the
    number of rows, so a row is reduced the same way in any batch (batch-invariant mode)."""
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight, residual), device=x.device)
    res_out = _launch(x, weight, eps, residual, out, None, fixed_tiling)
    return out if res_out is None else (out, res_out)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None):
    """The norm's output dtype: the weight's and the (summed) input's, promoted."""
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    return torch.promote_types(weight.dtype, sum_dtype)


def _launch(x, weight, eps, residual, out, scale, fixed_tiling=False) -> torch.Tensor | None:
    """Normalise ``x`` (plus ``residual``) into ``out`` (quantized, with ``scale``); returns
    the sum with the residual, where there is one."""
    res_out = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        sum_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    x, sxt, sxh = _rows(x)
    n = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    num_rows = x.shape[0] * heads
    srt = srh = 0
    if residual is not None:
        residual, srt, srh = _rows(residual)
    if num_rows == 0:
        return res_out
    block_m, block_n, warps = launch_shape(n, num_rows, fixed_tiling)
    _rms_norm_kernel_launch(
        (triton.cdiv(num_rows, block_m),),
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out if res_out is not None else out,
        scale if scale is not None else out,
        num_rows,
        heads,
        n,
        sxt,
        sxh,
        srt,
        srh,
        eps,
        FP8_MAX,
        FP8_INV_MAX,
        MIN_SCALE,
        HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        QUANT=scale is not None,
        num_warps=warps,
    )
    return res_out


def rms_norm_fp8_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> QuantizedRows | tuple[QuantizedRows, torch.Tensor]:
    """:func:`rms_norm_triton` of a [tokens, hidden] ``x`` with its output quantized a row at a
    time for an FP8 linear (:class:`~pagoda.ops.fp8.QuantizedRows`): the same FP8 values and
    scales as ``quantize_tokens(rms_norm_triton(...))``, without storing the output and reading
    it again."""
    if x.dim() != 2:
        raise ValueError(f"rms_norm_fp8 takes a 2-D tensor, got shape {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    res_out = _launch(x, weight, eps, residual, out, scale)
    rows = QuantizedRows(out, scale, _out_dtype(x, weight, residual))
    return rows if res_out is None else (rows, res_out)
