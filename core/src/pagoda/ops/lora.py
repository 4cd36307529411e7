"""Batched LoRA: many adapters' low-rank products in one pass over a step's tokens (Punica's
SGMV and BGMV), as a torch reference and the dispatch to the Triton kernels.

An adapter lives in a device slot: ``a`` [slots, R, K] (shrink: K inputs to R ranks) and ``b``
[slots, N, R] (expand: R ranks to N outputs), its scaling folded into ``b``. Each step says
which slot each token uses (-1: none, the base model) in one of two ways:

- segments (SGMV, prefill and mixed steps): ``seg_starts`` [n + 1] (a request's tokens are
  contiguous in the flat batch) and ``seg_slots`` [n], with the longest segment's length;
- rows (BGMV, decode steps and CUDA graphs): ``token_slots`` [tokens], one slot per token.

``shrink`` gives ``y = x @ a[slot].T`` in float32 (rows without a slot hold garbage that no
expand reads); ``expand`` adds ``y[:, off:off + R] @ b[slot].T`` into ``out`` in place, which may
be a column slice of a wider output (q, k and v of one projection). The kernels read no device
memory on the host, so a BGMV step replays in a CUDA graph with the slots as inputs.

A rows step runs one of the ``DECODE_KERNELS`` (``add_lora`` dispatches, but for ``folded``,
which the wrapped layer runs itself; the CPU's torch reference is the same for all): ``folded``
(the default: every slot's A stacked under the base weight as extra output rows, so that the
base GEMM also gives every slot's shrink, then one expand launch a projection,
:func:`expand_folded`, each row reading its own slot's columns), ``bgmv`` (a shrink and an
expand launch a projection), ``bgmv-wide`` (the same two kernels, a slice's ranks a shrink
program and wider expand blocks), ``fused-rows`` (one launch: a program a token and block of
output columns, which recomputes its slice's rank-R shrink) and ``fused-slots`` (one launch over
the rows sorted by slot, the batch's ``sorted_rows`` and ``slot_starts``: a program a slot's
block of rows and of output columns, which reads the slot's A and B once for all its rows, by
``tl.dot``).

``folded`` is the default because it was the fastest (``benchmarks/lora_kernels.py`` on an H200,
a decode step of Qwen3-0.6B's projections at 64 rows over 8 slots of rank 16: the base linears
alone 673 us, with ``bgmv`` 1503 us, ``folded`` 1034 us): the shrink launches are gone and the
GEMM reads the slots' A on its way through the base weight. Its shrink is rounded to the
weights' dtype (the others keep it in float32). It needs the layer's stacked weight
(``pagoda.lora.layers.LoRALinear``): ``add_lora`` asked for it runs ``bgmv``, as a layer that
cannot stack its weight (a quantized one) does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.ops import _use_triton

DECODE_KERNELS = ("folded", "bgmv", "bgmv-wide", "fused-rows", "fused-slots")
#: The kernel a rows (decode, CUDA graph) step runs, read once (``benchmarks/lora_kernels.py``
#: times each; ``benchmarks/README.md`` says why this one).
DECODE_KERNEL = os.environ.get("PAGODA_LORA_DECODE_KERNEL", "folded")
if DECODE_KERNEL not in DECODE_KERNELS:
    raise ValueError(
        f"PAGODA_LORA_DECODE_KERNEL={DECODE_KERNEL!r}: expected one of {', '.join(DECODE_KERNELS)}"
    )


@dataclass
class LoRABatch:
    """Which adapter slot each token of a step uses (the module docstring's two forms).

    ``segments`` holds the host's copy of the segments, (start, end, slot) with slot >= 0, which
    the torch reference reads; ``use_rows``: run BGMV over ``token_slots`` (CUDA graphs).
    ``sorted_rows`` and ``slot_starts`` (:func:`sort_rows`): what ``fused-slots`` reads."""

    token_slots: torch.Tensor
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor
    max_seg_len: int
    segments: list[tuple[int, int, int]]
    use_rows: bool = False
    sorted_rows: torch.Tensor | None = None
    slot_starts: torch.Tensor | None = None


def sort_rows(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows with an adapter grouped by slot, int32: ``sorted_rows`` [tokens] (slot 0's rows,
    then slot 1's, ...; the rows without an adapter after them) and ``slot_starts`` [num_slots
    + 1] (slot s's rows are ``sorted_rows[slot_starts[s] : slot_starts[s + 1]]``)."""
    key = np.where(token_slots < 0, num_slots, token_slots)
    order = np.argsort(key, kind="stable").astype(np.int32)
    starts = np.zeros(num_slots + 1, dtype=np.int32)
    np.cumsum(np.bincount(key, minlength=num_slots + 1)[:num_slots], out=starts[1:])
    return order, starts


def add_lora(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    batch: LoRABatch,
    out: torch.Tensor,
    bounds: tuple[int, ...] = (),
    kernel: str | None = None,
) -> None:
    """``out += (x @ a[slot].T) @ b[slot].T`` by slices (:func:`expand`), a rows step by the
    decode kernel ``kernel`` (None: ``DECODE_KERNEL``; ``folded``, which needs the stacked
    weight this call has not got: ``bgmv``)."""
    kernel = kernel or DECODE_KERNEL
    if batch.use_rows and kernel not in ("bgmv", "folded") and _use_triton(x):
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops import triton_lora

        slots = batch.token_slots[: x.shape[0]]
        if kernel == "bgmv-wide":
            y = triton_lora.bgmv_shrink(x, a, slots, wide=True)
            triton_lora.bgmv_expand(y, b, slots, out, bounds, wide=True)
        elif kernel == "fused-rows":
            triton_lora.fused_rows(x, a, b, slots, out, bounds)
        elif kernel == "fused-slots":
            if batch.sorted_rows is None or batch.slot_starts is None:
                raise ValueError("fused-slots needs the batch's sorted_rows and slot_starts")
            triton_lora.fused_slots(x, a, b, batch.sorted_rows, batch.slot_starts, out, bounds)
        else:
            raise ValueError(f"unknown LoRA decode kernel {kernel!r}: one of {DECODE_KERNELS}")
        return
    expand(shrink(x, a, batch), b, batch, out, bounds)


def expand_folded(
    y: torch.Tensor,
    n: int,
    b: torch.Tensor,
    batch: LoRABatch,
    bounds: tuple[int, ...],
    slot_stride: int,
) -> None:
    """The ``folded`` rows step's expand: ``y`` [tokens, n + slots * slot_stride] is the output
    of the base weight with every slot's A stacked under it (columns ``n + s * slot_stride`` on:
    slot ``s``'s shrink, its slices' ranks in turn); adds each token's own slot's product into
    ``y[:, :n]`` by slices (:func:`expand`), in place. Rows without a slot are left as they
    are."""
    slots = batch.token_slots[: y.shape[0]]
    if _use_triton(y):
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops import triton_lora

        triton_lora.bgmv_expand(y[:, n:], b, slots, y[:, :n], bounds, slot_stride=slot_stride)
        return
    # The reference: each row's own slot's shrink columns gathered, then the rows expand.
    width = (len(bounds) + 1) * b.shape[2]
    cols = n + slots.clamp(min=0).long().unsqueeze(1) * slot_stride
    own = y.gather(1, cols + torch.arange(width, device=y.device)).float()
    expand(own, b, batch, y[:, :n], bounds)


def shrink(x: torch.Tensor, a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """[tokens, R] float32: each token's ``x @ a[slot].T``."""
    if _use_triton(x):
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops import triton_lora

        if batch.use_rows:
            return triton_lora.bgmv_shrink(x, a, batch.token_slots[: x.shape[0]])
        return triton_lora.sgmv_shrink(x, a, batch.seg_starts, batch.seg_slots, batch.max_seg_len)
    if batch.use_rows:
        return bgmv_shrink_reference(x, a, batch.token_slots[: x.shape[0]])
    return sgmv_shrink_reference(x, a, batch.segments)


def expand(
    y: torch.Tensor,
    b: torch.Tensor,
    batch: LoRABatch,
    out: torch.Tensor,
    bounds: tuple[int, ...] = (),
) -> None:
    """``out += y @ b[slot].T`` for the tokens with a slot, in place, by slices: ``b`` [slots,
    N, R] and ``out`` [tokens, N] split at the column ``bounds`` (q | k | v of one projection),
    slice i reading ``y[:, i * R : (i + 1) * R]``. BGMV does every slice in one launch."""
    if _use_triton(y) and batch.use_rows:
        # NOTE: Triton compiles on import: only where the kernel path runs.
        from pagoda.ops import triton_lora

        triton_lora.bgmv_expand(y, b, batch.token_slots[: y.shape[0]], out, bounds)
        return
    r = b.shape[2]
    edges = (0, *bounds, b.shape[1])
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        _expand_slice(y, b[:, lo:hi], batch, out[:, lo:hi], i * r)


def _expand_slice(
    y: torch.Tensor, b: torch.Tensor, batch: LoRABatch, out: torch.Tensor, offset: int
) -> None:
    if _use_triton(y):
        from pagoda.ops import triton_lora

        triton_lora.sgmv_expand(
            y, b, batch.seg_starts, batch.seg_slots, batch.max_seg_len, out, offset
        )
    elif batch.use_rows:
        bgmv_expand_reference(y, b, batch.token_slots[: y.shape[0]], out, offset)
    else:
        sgmv_expand_reference(y, b, batch.segments, out, offset)


# ---- torch references ---------------------------------------------------------------------------


def sgmv_shrink_reference(
    x: torch.Tensor, a: torch.Tensor, segments: list[tuple[int, int, int]]
) -> torch.Tensor:
    y = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for start, end, slot in segments:
        y[start:end] = x[start:end].float() @ a[slot].float().T
    return y


def sgmv_expand_reference(
    y: torch.Tensor,
    b: torch.Tensor,
    segments: list[tuple[int, int, int]],
    out: torch.Tensor,
    offset: int = 0,
) -> None:
    r = b.shape[2]
    for start, end, slot in segments:
        delta = y[start:end, offset : offset + r] @ b[slot].float().T
        out[start:end] += delta.to(out.dtype)


def bgmv_shrink_reference(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    rows = a[slots.clamp(min=0).long()].float()  # [tokens, R, K]
    y = torch.einsum("trk,tk->tr", rows, x.float())
    return y.masked_fill((slots < 0).unsqueeze(1), 0.0)


def bgmv_expand_reference(
    y: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, offset: int = 0
) -> None:
    r = b.shape[2]
    rows = b[slots.clamp(min=0).long()].float()  # [tokens, N, R]
    delta = torch.einsum("tnr,tr->tn", rows, y[:, offset : offset + r])
    delta = delta.masked_fill((slots < 0).unsqueeze(1), 0.0)
    out += delta.to(out.dtype)
