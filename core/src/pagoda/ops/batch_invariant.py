"""Batch-invariant mode: every row's result independent of the batch it is computed in.

A GEMM library picks its kernel, tiling and reduction split by the shape of the call, and a
reduction picks how many threads share a row by how many rows there are; so a token's hidden
state, and with it its logits, change in the last bits with what else is in the batch and with
how its prompt was chunked. In this mode every operation that reduces across a row runs on
*fixed shapes*:

- matmuls (:func:`linear`): the rows are cut into tiles of exactly ``row_tile`` rows (the last
  one padded), one library call per tile; a call of one shape runs one kernel, whose result for
  a row does not depend on the other rows of its tile (checked by the tests on each device);
- row-wise operations on a CPU (:func:`rms_norm`, :func:`silu_and_mul`, :func:`log_softmax`,
  and the sampler through :func:`fixed_rows`): chunks of a fixed number of rows, small enough
  that torch runs them on one thread with no split of a row and no scalar tail; on CUDA the
  RMSNorm kernel runs with one fixed tiling;
- attention: :mod:`pagoda.attention.batch_invariant`, keys visited in tiles of a fixed size
  from position 0 for every query token, with no split of the context.

Elementwise operations, gathers, ``max``/``argmax``/``topk`` are exact and need nothing.

The mode is process-wide (``model.batch_invariant``, or ``VLLM_BATCH_INVARIANT=1`` as in vLLM)
and read at each call: the model runner sets it before it captures CUDA graphs, so the graphs
hold the invariant kernels.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from pagoda.ops import reference

__all__ = [
    "ENV_VAR",
    "batch_invariant_enabled",
    "env_requests_batch_invariant",
    "fixed_rows",
    "linear",
    "log_softmax",
    "rms_norm",
    "row_tile",
    "set_batch_invariant",
    "silu_and_mul",
]

ENV_VAR = "VLLM_BATCH_INVARIANT"

# Rows of one GEMM call. On a CPU 64 rows cost about what 8 do (the weights' reads dominate);
# on CUDA 128 rows are one tile of the common cuBLAS kernels, and decode steps stay bound by the
# weights' reads.
_CPU_ROW_TILE = 64
_CUDA_ROW_TILE = 128
# torch runs an elementwise loop or a reduction on one thread below this many elements
# (at::internal::GRAIN_SIZE); one thread, and rows a multiple of the widest vector, leave no
# split of a row and no scalar remainder.
_GRAIN = 32768
_VECTOR = 64
# Sampler rows per fixed-shape chunk. On a CPU one: a vocabulary row is past the grain, so torch
# splits it over the threads, and only a chunk of one row splits every row the same way whatever
# the thread count. On CUDA more, as a chunk costs its launches.
_CPU_SAMPLER_ROWS = 1
_CUDA_SAMPLER_ROWS = 64

_enabled = False


def set_batch_invariant(enabled: bool) -> None:
    """Turn the mode on or off for this process.

    NOTE: read at each call, so set it before a CUDA graph is captured.
    """
    global _enabled
    _enabled = bool(enabled)


def batch_invariant_enabled() -> bool:
    return _enabled


def env_requests_batch_invariant() -> bool:
    """Whether ``VLLM_BATCH_INVARIANT`` asks for the mode (vLLM's switch: ``1`` is on)."""
    return os.environ.get(ENV_VAR, "0").strip().lower() in ("1", "true", "yes", "on")


@cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def row_tile(device: torch.device) -> int:
    """Rows of every GEMM call on ``device`` in this mode."""
    return _CUDA_ROW_TILE if device.type == "cuda" else _CPU_ROW_TILE


def sampler_rows(device: torch.device) -> int:
    return _CUDA_SAMPLER_ROWS if device.type == "cuda" else _CPU_SAMPLER_ROWS


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows``."""
    if x.shape[0] == rows:
        return x
    padded = x.new_zeros((rows, *x.shape[1:]))
    padded[: x.shape[0]] = x
    return padded


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with every GEMM call of ``row_tile`` rows: a row's result does
    not depend on how many rows ``x`` has or where the row sits."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # one layout: one kernel
    m, tile = x2.shape[0], row_tile(x.device)
    padded = _pad_rows(x2, -(-max(m, 1) // tile) * tile)
    out = x2.new_empty((padded.shape[0], weight.shape[0]))
    wt = weight.t()
    for start in range(0, padded.shape[0], tile):
        torch.mm(padded[start : start + tile], wt, out=out[start : start + tile])
    out = out[:m]
    if bias is not None:
        out = out + bias  # elementwise: exact per element
    return out.reshape(*lead, weight.shape[0])


def _chunk_rows(width: int) -> int:
    """Rows of a CPU chunk of ``width``-element rows: one thread, no scalar remainder."""
    if width % _VECTOR:
        return 1
    return max(1, (_GRAIN - 1) // width)


def fixed_rows(
    fn: Callable[..., torch.Tensor],
    rows: int,
    x: torch.Tensor,
    *row_args: torch.Tensor | None,
) -> torch.Tensor:
    """``fn(x, *row_args)`` computed on chunks of exactly ``rows`` rows of ``x`` and of each
    per-row argument (the last chunk padded by repeating row 0), so that every call has one
    shape; ``fn`` works row by row and returns one row per input row. ``None`` arguments pass
    through."""
    n = x.shape[0]
    if n == 0:
        return fn(x, *row_args)
    total = -(-n // rows) * rows
    index = torch.arange(total, device=x.device)
    index[n:] = 0
    parts = []
    for start in range(0, total, rows):
        idx = index[start : start + rows]
        chunk_args = [a if a is None else a.index_select(0, idx) for a in row_args]
        parts.append(fn(x.index_select(0, idx), *chunk_args))
    return torch.cat(parts)[:n]


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`pagoda.ops.rms_norm` with a row's result independent of the batch."""
    if x.is_cuda and _have_triton():
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops.triton_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual, fixed_tiling=True)
    shape = x.shape
    width = shape[-1]
    flat = x.reshape(-1, width)
    rows = sampler_rows(x.device) if x.is_cuda else _chunk_rows(width)
    if residual is None:
        out = fixed_rows(lambda a: reference.rms_norm(a, weight, eps), rows, flat)
        return out.reshape(shape)
    res = residual.reshape(-1, width)
    # The sum is elementwise (exact); the norm of it goes through the chunks.
    total = flat + res
    out = fixed_rows(lambda a: reference.rms_norm(a, weight, eps), rows, total)
    return out.reshape(shape), total.reshape(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`pagoda.ops.silu_and_mul` on fixed CPU chunks (on CUDA the elementwise kernels are
    exact per element and need none)."""
    flat = x.reshape(-1, x.shape[-1])
    out = fixed_rows(reference.silu_and_mul, _chunk_rows(x.shape[-1]), flat)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 2)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise ``log_softmax`` in float32 over chunks of a fixed number of rows."""
    return fixed_rows(
        lambda a: F.log_softmax(a.float(), dim=-1), sampler_rows(logits.device), logits
    )
