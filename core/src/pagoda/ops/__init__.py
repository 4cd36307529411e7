"""The model's elementwise and normalisation operations: fused Triton kernels on CUDA, torch code
elsewhere.

Each public function takes the same tensors on every device and gives the same result up to the
rounding of fp32 intermediates (the reduction order of a norm, the ``exp`` of SiLU). Triton is
optional: without it, or with :func:`set_fused_ops` ``(False)``, or on a CPU, the torch reference in
:mod:`pagoda.ops.reference` runs. The kernels launch on fixed grids computed from shapes alone and
never read device memory on the host, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from pagoda.ops import batch_invariant, cpu_packed, fused_moe, reference
from pagoda.ops.draw import sample_from_probs

__all__ = [
    "fused_experts",
    "fused_ops_enabled",
    "gate_up_silu",
    "kv_write_fused",
    "linear",
    "linear_add_",
    "qk_norm_rotary",
    "qkv_norm_rotary",
    "rms_norm",
    "rms_norm_fp8",
    "rotary_embedding",
    "sample_from_logits",
    "set_fused_ops",
    "silu_and_mul",
]

_enabled = True


def set_fused_ops(enabled: bool) -> None:
    """Use the fused kernels where they can run (the default), or always the torch code.

    NOTE: read at each call, so set it before a CUDA graph is captured: a replay keeps the kernels
    that were captured.
    """
    global _enabled
    _enabled = bool(enabled)


def fused_ops_enabled() -> bool:
    return _enabled


@cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(x: torch.Tensor) -> bool:
    if not _enabled:
        return False
    if x.is_cuda:
        return _have_triton()
    # NOTE: the interpreter runs the kernels on a CPU for tests; it must be asked for by name as
    # well (as the Triton attention backend does), or every CPU model of a test session that set
    # TRITON_INTERPRET would run interpreted kernels, thousands of times slower.
    return (
        x.device.type == "cpu"
        and os.environ.get("TRITON_INTERPRET") == "1"
        and os.environ.get("PAGODA_TRITON_ON_CPU") == "1"
        and _have_triton()
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * rmsnorm(x)`` over the last dimension; with ``residual``, of ``x + residual``,
    returned with that sum (the next layer's residual). ``x``: [tokens, hidden] or
    [tokens, heads, head_dim] (strided views are fine); the inputs are not modified."""
    if batch_invariant._enabled:
        return batch_invariant.rms_norm(x, weight, eps, residual)
    if _use_triton(x):
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops.triton_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> Any:
    """:func:`rms_norm` of a [tokens, hidden] ``x`` with its output quantized a row at a time
    for an FP8 linear, in the norm's own kernel: a :class:`~pagoda.ops.fp8.QuantizedRows` (with
    ``residual``, and the sum), holding what ``quantize_tokens`` of the output would. None where
    that kernel does not run (no Triton, batch-invariant mode, an output of another dtype than
    the sum's): the caller normalises and the linear quantizes."""
    if batch_invariant._enabled or not FUSED_NORM_FP8 or not _use_triton(x) or x.dim() != 2:
        return None
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    if (
        sum_dtype not in _NORM_FP8_DTYPES
        or torch.promote_types(weight.dtype, sum_dtype) != sum_dtype
    ):
        return None
    # NOTE: Triton compiles on import: only where the kernel path runs.
    from pagoda.ops.triton_norm import rms_norm_fp8_triton

    return rms_norm_fp8_triton(x, weight, eps, residual)


# Whether a norm whose output an FP8 linear reads quantizes it in its own kernel
# (:func:`rms_norm_fp8`); off, the linear quantizes the stored output (an A/B switch).
FUSED_NORM_FP8 = True
# NOTE: 16-bit models only: in float32 the kernel's FP8 values parted from the stored norm's on
# an H200 (bfloat16 and float16 are the same bit for bit there).
_NORM_FP8_DTYPES = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; in batch-invariant mode with each row's result independent of the batch.
    On a CPU, a product of a few rows runs through oneDNN with the weight packed once
    (:mod:`pagoda.ops.cpu_packed`: MKL takes such a product about as a row at a time)."""
    if batch_invariant._enabled:
        return batch_invariant.linear(x, weight, bias)
    if not x.is_cuda:
        out = cpu_packed.linear(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


# Whether steps of at least RESIDUAL_IN_EPILOGUE_MIN_ROWS rows add a residual projection into
# the residual in the GEMM's epilogue (:func:`linear_add_`); smaller ones (decode, captured in
# CUDA graphs) always project and add apart. On an H200, embedding calls at the board's power
# limit ran 0.5% faster with it (benchmarks/README.md, "The residual in the projections'
# epilogue").
RESIDUAL_IN_EPILOGUE = True
RESIDUAL_IN_EPILOGUE_MIN_ROWS = 4096


def linear_add_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``residual += x @ weight.T`` in place, in the GEMM's epilogue (cuBLAS reads ``residual``
    as its C with beta 1), where it pays: on a GPU, a step of at least
    ``RESIDUAL_IN_EPILOGUE_MIN_ROWS`` rows, outside batch-invariant mode. Returns whether it
    did; where it did not, nothing was done and the caller projects and adds apart (the next
    norm's fused add).

    Against projecting then letting the norm add: the projection's output is never written and
    read back (a large step's activations pass through memory once less a norm). The sum is as
    close as projecting then adding apart (cuBLAS's epilogue need not round it only once).
    ``residual`` must be the caller's own tensor: it is overwritten."""
    if not (
        RESIDUAL_IN_EPILOGUE
        and residual.is_cuda
        and not batch_invariant._enabled
        and x.dim() == 2
        and x.shape[0] >= RESIDUAL_IN_EPILOGUE_MIN_ROWS
        and residual.shape == (x.shape[0], weight.shape[0])
        and residual.dtype == x.dtype == weight.dtype
        and residual.is_contiguous()
    ):
        return False
    residual.addmm_(x, weight.t())
    return True


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x`` = [..., 2 * I] holding gate then up; returns [..., I]."""
    if batch_invariant._enabled and not x.is_cuda:
        return batch_invariant.silu_and_mul(x)
    if _use_triton(x):
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops.triton_activation import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return reference.silu_and_mul(x)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``silu(x @ gate.T) * (x @ up.T)`` for ``weight`` = ``[gate; up]`` ([2 * I, K]) in one
    kernel (:mod:`pagoda.ops.triton_gated_gemm`), where it runs and pays: a step of at least its
    ``MIN_ROWS`` rows on a Hopper device, outside batch-invariant mode. None elsewhere: the
    caller runs the projection and :func:`silu_and_mul`."""
    if batch_invariant._enabled or not _use_triton(x):
        return None
    from pagoda.ops import triton_gated_gemm

    if x.shape[0] < triton_gated_gemm.MIN_ROWS or not triton_gated_gemm.supported(x, weight):
        return None
    return triton_gated_gemm.gate_up_silu_triton(x, weight)


def qkv_norm_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_store: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """The qkv projection ``x @ weight.T`` with each q and k head normalised and rotated, as
    the projection then :func:`qk_norm_rotary` give them, in one kernel
    (:mod:`pagoda.ops.triton_qkv_norm_rotary`) where it is enabled and runs: a step of at least
    its ``MIN_ROWS`` rows on a Hopper device, outside batch-invariant mode. None elsewhere: the
    caller runs the two apart. ``kv_store``: (a KV cache, the rows' slots), where the kernel
    also stores each row's keys and values (``Attention.kv_store_target``)."""
    if batch_invariant._enabled or not _use_triton(x):
        return None
    from pagoda.ops import triton_qkv_norm_rotary as fused

    if (
        not fused.ENABLED
        or x.shape[0] < fused.MIN_ROWS
        or positions.dim() != 1
        or cos.shape[-1] * 2 != head_dim  # a partial rotation: the separate kernels
        or not fused.supported(x, weight, head_dim)
    ):
        return None
    cache, slots = kv_store if kv_store is not None else (None, None)
    return fused.qkv_norm_rotary_triton(
        x, weight, q_heads, kv_heads, head_dim, q_weight, k_weight, eps, positions, cos, sin,
        kv_cache=cache, slot_mapping=slots,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (rotate halves) of ``q``: [tokens, heads, head_dim] and
    ``k``: [tokens, kv_heads, head_dim] at ``positions`` [tokens], from float32 tables ``cos`` and
    ``sin`` [max_position, head_dim / 2]. The fused kernel rotates ``q`` and ``k`` in place (strided
    views, such as the split of a qkv projection, are fine); use the returned tensors."""
    if _use_triton(q):
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops.triton_rotary import rotary_embedding_triton

        return rotary_embedding_triton(positions, q, k, cos, sin)
    return reference.rotary_embedding(positions, q, k, cos, sin)


def qk_norm_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` of every head of ``q`` [tokens, heads, head_dim] with ``q_weight`` and of
    ``k`` [tokens, kv_heads, head_dim] with ``k_weight``, then :func:`rotary_embedding` of both
    (Qwen3's attention): one fused kernel on CUDA, the two operations elsewhere and in
    batch-invariant mode. The inputs are not modified; use the returned tensors."""
    if not batch_invariant._enabled and _use_triton(q):
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops.triton_qk_norm_rotary import qk_norm_rotary_triton

        return qk_norm_rotary_triton(positions, q, k, q_weight, k_weight, eps, cos, sin)
    q = rms_norm(q, q_weight, eps)
    k = rms_norm(k, k_weight, eps)
    return rotary_embedding(positions, q, k, cos, sin)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """A mixture of experts' routed experts (:mod:`pagoda.ops.fused_moe`): ``x`` [n, H], stacked
    ``w13`` [E, 2 * I, H] (gate rows, then up rows) and ``w2`` [E, H, I], each token's experts
    ``topk_ids`` [n, k] (-1: none) and weights ``topk_weights`` [n, k]; returns [n, H]. The
    grouped-GEMM Triton kernels where they run (batch-invariant in that mode), else torch."""
    if _use_triton(x):
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops.triton_fused_moe import fused_experts_triton

        return fused_experts_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe.fused_experts_reference(x, w13, w2, topk_weights, topk_ids)


def fused_draw_applies(logits: torch.Tensor) -> bool:
    """Whether :func:`sample_from_logits` runs its one-kernel draw on ``logits`` (the sampler
    keeps its own path elsewhere, and always in batch-invariant mode)."""
    return not batch_invariant._enabled and _use_triton(logits)


def sample_from_logits(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """[n] int64: each row of ``logits`` [n, vocab] drawn from ``softmax(logits / temperature)``
    with its ``uniform`` [n] float64 in [0, 1), by the inverse-CDF draw of
    :func:`pagoda.ops.draw.sample_from_probs`. One Triton kernel reads the logits once or twice
    where :func:`fused_draw_applies`; elsewhere the sampler's torch code runs."""
    if fused_draw_applies(logits):
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops.triton_sample import sample_from_logits_triton

        return sample_from_logits_triton(logits, temperature, uniform)
    probs = (logits.float() / temperature.unsqueeze(1)).softmax(dim=-1)
    return sample_from_probs(probs, uniform)


def kv_write_fused(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Whether :func:`pagoda.attention.backend.write_kv_cache` stores these keys and values
    with the one-kernel write (:mod:`pagoda.ops.triton_kv_write`): where the fused kernels run
    and the kernel can address the cache (contiguous, keys and values as wide as its heads,
    unit stride in the head dimension, an FP8 cache with both scales)."""
    return (
        _use_triton(key)
        and kv_cache.is_contiguous()
        and key.shape[2] == value.shape[2] == kv_cache.shape[-1]
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and (kv_cache.dtype != torch.float8_e4m3fn or (k_scale is not None and v_scale is not None))
    )
