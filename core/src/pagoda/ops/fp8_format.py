"""The FP8 e4m3 format: its range, and scaled casts to and from it (torch code, any device).

A tensor ``x`` is stored as ``q = fp8(x / s)`` with a float32 scale ``s`` (one per tensor, per
row or per token) and read back as ``q * s``. Casts clamp to the format's range first: e4m3fn
has no infinity, and a CUDA cast of a value past it gives NaN.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
#: ``1 / 448`` as float32 holds it: a scale is ``amax * FP8_INV_MAX`` (:func:`scale_of`).
FP8_INV_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
#: The smallest scale a quantizer gives: an all-zero row stays finite.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def to_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``fp8(x / scale)``, clamped to the format's range; ``scale`` broadcasts against ``x``."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def from_fp8(q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (the product taken in float32)."""
    return (q.float() * scale).to(dtype)


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scale of values whose largest magnitude is ``amax``: ``amax * (1 / 448)``, at
    least :data:`MIN_SCALE`. The same bits on every device: one float32 product, rounded to
    nearest, where ``amax / 448`` is not (CUDA divides by a scalar as a product with its
    reciprocal, the CPU divides, and the two differ in the last bit for about half the values:
    an FP8 checkpoint written on a CPU then held other scales than a GPU's online
    quantization). The Triton kernel (:mod:`pagoda.ops.triton_fp8`) computes the same."""
    return (amax.float() * FP8_INV_MAX).clamp_(min=MIN_SCALE)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` [..., K] with its own scale (:func:`scale_of` its ``amax``): (fp8
    values, float32 scales [..., 1]). Weights per output channel, activations per token."""
    scale = scale_of(x.abs().amax(dim=-1, keepdim=True))
    return to_fp8(x, scale), scale


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All of ``x`` with one scale (:func:`scale_of` its ``amax``): (fp8 values, float32 scale
    [1])."""
    scale = scale_of(x.abs().amax()).reshape(1)
    return to_fp8(x, scale), scale
