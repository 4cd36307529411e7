"""Linear layers of few rows (decode steps) in Triton: ``x @ weight.T (+ bias)``.

At a decode step's batch the projections read far more weight than they compute with, so the
time is the weight's bytes over the memory bandwidth plus the kernel's start. This kernel gives
each program a strip of ``BLOCK_N`` output columns over every row of ``x`` and walks the whole
reduction in pipelined tiles: enough programs to cover the multiprocessors for the projections of
small models (``BLOCK_N`` 16 over 1,024 columns is 64 programs), no split of the reduction and so
no second pass, fp32 accumulation and one rounding to the output dtype. With ``silu_mul`` the
input is the MLP's [rows, 2 * K] gate/up projection and ``silu(gate) * up`` is formed while it
loads (rounded as :func:`pagoda.ops.reference.silu_and_mul` rounds), which removes that kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# NOTE: the row count is not specialised on (Triton would compile a variant for multiples of 16).
@triton.jit(do_not_specialize=["m"])
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + rk
        xm = (rm[:, None] < m) & (kk[None, :] < k)
        if SILU_MUL:
            gate = tl.load(x_rows + kk[None, :], mask=xm, other=0.0).to(tl.float32)
            up = tl.load(x_rows + k + kk[None, :], mask=xm, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(w_ptr.dtype.element_ty).to(tl.float32)
            xt = (act * up).to(w_ptr.dtype.element_ty)
        else:
            xt = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
        wt = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < n) & (kk[None, :] < k), other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < n, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < m) & (rn[None, :] < n))


def skinny_launch(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for ``m`` rows of an ``n`` x ``k``
    weight."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 16 if n <= 2048 else 32
    return block_m, block_n, 256, 4, 4


def skinny_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    launch: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x`` [..., K] (with ``silu_mul``, [..., 2 * K] holding gate then up) times ``weight``
    [N, K] transposed, plus ``bias`` [N]: [..., N] in ``x``'s dtype. ``launch`` overrides
    :func:`skinny_launch` (for tuning)."""
    n, k = weight.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if rows.shape[-1] != (2 * k if silu_mul else k):
        raise ValueError(f"skinny_linear: input of {rows.shape[-1]} features for a weight {n}x{k}")
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        bm, bn, bk, warps, stages = launch or skinny_launch(m, n, k)
        _skinny_linear_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
            rows,
            weight,
            bias if bias is not None else weight,
            y,
            m,
            n,
            k,
            rows.stride(0),
            weight.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            SILU_MUL=silu_mul,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=warps,
            num_stages=stages,
        )
    return y.view(*lead, n)
