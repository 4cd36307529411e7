"""A step's six input arrays (input ids, positions, key and value slots, query starts, sequence
lengths, block table) in one host-to-device copy and one kernel.

Copied one by one, each array is a page-locked staging write and a ``copy_``: about 18 us of
host time each on an H200's host, 108 of the 466 us a batch-1 verification launch spent between
reading the step before and replaying its graph (the host's part of the step's critical path).
Here the host packs them into one int64 array, copies it once, and one Triton kernel, launched
through :class:`~pagoda.ops.launch.CachedLaunch`, stores each part in its buffer (the 32-bit
ones converted). :func:`unpack_torch` is the reference it must equal
(``tests/unit/test_step_inputs_kernel.py``); where the kernel is not available (a CPU, no
Triton, or it failed its check at start-up) the arrays are copied one by one.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the arrays are copied one by one instead
    triton = None

from pagoda.ops.launch import CachedLaunch

logger = logging.getLogger(__name__)

_BLOCK = 1024

if triton is not None:

    @triton.jit(
        do_not_specialize=[
            "packed_ptr",
            "ids_ptr",
            "pos_ptr",
            "slots_ptr",
            "qsl_ptr",
            "seq_lens_ptr",
            "table_ptr",
            "n_tok",
            "n_req",
            "cols",
            "table_stride",
            "total",
        ]
    )
    def _unpack(
        packed_ptr,  # [total] int64: ids, positions, slots (n_tok each), qsl (n_req + 1),
        # seq_lens (n_req), the table's rows (n_req * cols)
        ids_ptr,  # int64 out
        pos_ptr,  # int64 out
        slots_ptr,  # int64 out
        qsl_ptr,  # int32 out
        seq_lens_ptr,  # int32 out
        table_ptr,  # int32 out, rows table_stride apart
        n_tok,
        n_req,
        cols,
        table_stride,
        total,
        BLOCK: tl.constexpr,
    ):
        g = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(packed_ptr + g, mask=g < total, other=0)
        tl.store(ids_ptr + g, v, mask=g < n_tok)
        tl.store(pos_ptr + (g - n_tok), v, mask=(g >= n_tok) & (g < 2 * n_tok))
        tl.store(slots_ptr + (g - 2 * n_tok), v, mask=(g >= 2 * n_tok) & (g < 3 * n_tok))
        q0 = 3 * n_tok
        tl.store(qsl_ptr + (g - q0), v.to(tl.int32), mask=(g >= q0) & (g <= q0 + n_req))
        s0 = q0 + n_req + 1
        tl.store(seq_lens_ptr + (g - s0), v.to(tl.int32), mask=(g >= s0) & (g < s0 + n_req))
        t0 = s0 + n_req
        t = g - t0
        cell = (t // cols) * table_stride + t % cols
        tl.store(table_ptr + cell, v.to(tl.int32), mask=(g >= t0) & (g < total))

    _launch = CachedLaunch(_unpack)


_failed: list[str] = []  # why the kernel is not used (failed its check at start-up)


def available(device: torch.device) -> bool:
    """Whether :func:`copy_step_inputs` takes the kernel for buffers on ``device``: CUDA, with
    Triton installed, and it passed its check at start-up (``warm``)."""
    return triton is not None and device.type == "cuda" and not _failed


def pack(
    ids: np.ndarray,
    positions: np.ndarray,
    slots: np.ndarray,
    qsl: np.ndarray,
    seq_lens: np.ndarray,
    table: np.ndarray,
) -> np.ndarray:
    """The six arrays as one int64 array, in the kernel's order."""
    return np.concatenate((ids, positions, slots, qsl, seq_lens, table.reshape(-1)), dtype=np.int64)


def unpack_torch(
    packed: torch.Tensor, out: tuple[torch.Tensor, ...], n_tok: int, n_req: int, cols: int
) -> None:
    """What the kernel does, in torch operations: ``out = (input_ids, positions, slot_mapping,
    query_start_loc, seq_lens, block_table)`` receive their parts of ``packed``."""
    ids, pos, slots, qsl, seq_lens, table = out
    parts = packed.split([n_tok, n_tok, n_tok, n_req + 1, n_req, n_req * cols])
    ids[:n_tok].copy_(parts[0])
    pos[:n_tok].copy_(parts[1])
    slots[:n_tok].copy_(parts[2])
    qsl[: n_req + 1].copy_(parts[3])
    seq_lens[:n_req].copy_(parts[4])
    table[:n_req, :cols].copy_(parts[5].view(n_req, cols))


def unpack(
    packed: torch.Tensor, out: tuple[torch.Tensor, ...], n_tok: int, n_req: int, cols: int
) -> None:
    """:func:`unpack_torch` in one launch of the kernel (``packed`` on the buffers' device)."""
    ids, pos, slots, qsl, seq_lens, table = out
    if table.stride(1) != 1:
        raise ValueError("the block table's rows must be contiguous")
    total = 3 * n_tok + 2 * n_req + 1 + n_req * cols
    grid = (triton.cdiv(total, _BLOCK),)
    args = (packed, ids, pos, slots, qsl, seq_lens, table, n_tok, n_req, cols, table.stride(0))
    # NOTE: the key holds the grid: a cached launch replays the grid it was first bound with.
    _launch((grid[0], packed.device.index), grid, (*args, total, _BLOCK), num_warps=4)


def warm(device: torch.device) -> None:
    """Compile the kernel now (start-up), not in a step, and check it against the torch
    operations; if it fails or differs, steps copy their arrays one by one from then on (said
    once, as a warning)."""
    if not available(device):
        return
    gen = torch.Generator(device=device).manual_seed(0)
    n_tok, n_req, cols, width = 37, 3, 5, 9
    total = 3 * n_tok + 2 * n_req + 1 + n_req * cols
    packed = torch.randint(0, 1 << 20, (total,), generator=gen, device=device)

    def buffers() -> tuple[torch.Tensor, ...]:
        i64 = {"dtype": torch.int64, "device": device}
        i32 = {"dtype": torch.int32, "device": device}
        return (
            torch.full((n_tok + 3,), -1, **i64),
            torch.full((n_tok + 3,), -1, **i64),
            torch.full((n_tok + 3,), -1, **i64),
            torch.full((n_req + 2,), -1, **i32),
            torch.full((n_req + 1,), -1, **i32),
            torch.full((n_req + 1, width), -1, **i32),
        )

    got, want = buffers(), buffers()
    try:
        unpack(packed, got, n_tok, n_req, cols)
        unpack_torch(packed, want, n_tok, n_req, cols)
        same = all(torch.equal(g, w) for g, w in zip(got, want))
        problem = None if same else "its buffers differ from the torch operations'"
    except Exception as e:  # noqa: BLE001 (the arrays are then copied one by one)
        problem = repr(e)
    if problem is not None:
        _failed.append(problem)
        logger.warning("step inputs: copied one by one (the kernel: %s)", problem)
