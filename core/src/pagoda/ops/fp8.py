"""FP8 (e4m3) arithmetic: scaled casts, the W8A8 linear, and whether a device has FP8 tensor cores.

The format and its casts are :mod:`pagoda.ops.fp8_format` (re-exported here).

The W8A8 linear quantizes each token (row) of the activations with its own scale (dynamic,
``amax * (1 / 448)``: :func:`scale_of`) and multiplies by weights quantized per output channel:
on a GPU with FP8 tensor cores (compute capability 8.9 and up) one cuBLASLt call
(``torch._scaled_mm``) with both scales applied to its float32 accumulators; elsewhere an
emulation that quantizes the same way and multiplies the dequantized values in float32 (what the
tests compare with).
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch

from pagoda.ops import _use_triton
from pagoda.ops.fp8_format import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    from_fp8,
    quantize_rows,
    quantize_tensor,
    scale_of,
    to_fp8,
)

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_MIN_CAPABILITY",
    "MIN_SCALE",
    "cuda_capability",
    "fp8_linear",
    "fp8_unsupported",
    "from_fp8",
    "quantize_rows",
    "quantize_tensor",
    "quantize_tokens",
    "scale_of",
    "to_fp8",
]

#: Compute capability from which a CUDA device multiplies FP8 (Ada, Hopper and later).
FP8_MIN_CAPABILITY = (8, 9)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability (a function of its own so that tests can stand in for
    another GPU)."""
    return torch.cuda.get_device_capability(device)


def fp8_unsupported(device: torch.device) -> str | None:
    """None when FP8 runs on ``device`` (natively on a GPU of compute capability 8.9 or more,
    emulated on a CPU), else why not, one line."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"FP8 does not run on {device.type} devices (CUDA and CPU only)"
    cap = cuda_capability(device)
    if tuple(cap) < FP8_MIN_CAPABILITY:
        want = ".".join(map(str, FP8_MIN_CAPABILITY))
        return (
            f"FP8 needs FP8 tensor cores (compute capability {want} or more: Ada, Hopper or "
            f"later); this GPU has compute capability {cap[0]}.{cap[1]}"
        )
    return None


class QuantizedRows(NamedTuple):
    """Activations [M, K] already quantized a row at a time, as :func:`quantize_tokens` would
    (a norm kernel that quantizes its output hands these to the FP8 linear that reads it:
    :func:`pagoda.ops.rms_norm_fp8`)."""

    data: torch.Tensor  # FP8 [M, K]
    scale: torch.Tensor  # float32 [M, 1]
    dtype: torch.dtype  # the activations' own: the linear's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def fp8_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    dequantized: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` with ``x`` [..., K] quantized per token (or
    given quantized: :class:`QuantizedRows`, [M, K]).

    ``weight`` [N, K] FP8, ``weight_scale`` [N] float32 (one per output channel); the result is in
    ``x``'s dtype. ``dequantized`` (the emulation's float32 ``weight * weight_scale``, kept by the
    caller) saves dequantizing the weight again each call."""
    shape = x.shape
    if isinstance(x, QuantizedRows):
        q, scale = x.data, x.scale
    else:
        # NOTE: one Triton kernel where Triton runs (interpreted on a CPU for tests), else the
        # torch code: the emulation quantizes as the GPU path does.
        q, scale = quantize_tokens(x.reshape(-1, shape[-1]))
    if q.is_cuda:
        out = _scaled_mm(q, scale, weight, weight_scale, x.dtype)
    else:
        out = _emulated(q, scale, weight, weight_scale, dequantized, x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])


def _emulated(
    q: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dequantized: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    w = dequantized if dequantized is not None else weight.float() * weight_scale[:, None]
    return ((q.float() * scale) @ w.T).to(dtype)


def _scaled_mm(
    q: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    # NOTE: cuBLASLt wants the second operand column-major: the [N, K] row-major weight's
    # transpose is exactly that, with no copy.
    wt = weight.t()
    # NOTE: cuBLASLt's per-row and per-column scales give bf16 results only.
    if dtype == torch.bfloat16 and _rowwise(q.device):
        return torch._scaled_mm(
            q, wt, scale_a=scale, scale_b=weight_scale.view(1, -1), out_dtype=dtype
        )
    # Ada (or a float16 or float32 model): tensor-wise scales only; the per-token and
    # per-channel scales are applied to the float32 product.
    one = _unit_scale(q.device)
    out = torch._scaled_mm(q, wt, scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (out * scale * weight_scale.view(1, -1)).to(dtype)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` of a [M, K] activation, in one Triton kernel where it runs."""
    if _use_triton(x):
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops.triton_fp8 import quantize_tokens_triton

        return quantize_tokens_triton(x)
    return quantize_rows(x)


_ROWWISE: dict[int, bool] = {}


def _rowwise(device: torch.device) -> bool:
    """Whether cuBLASLt takes per-row and per-column scales here (Hopper and later)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ROWWISE:
        _ROWWISE[index] = tuple(cuda_capability(device)) >= (9, 0)
    return _ROWWISE[index]


@cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 scale of one on ``device``, made once (not a fill kernel every linear)."""
    return torch.ones((), dtype=torch.float32, device=device)
