"""Greedy verification in one Triton kernel.

Where every row is greedy the rejection sampler only compares each draft with the target's argmax
at its position, counts the leading matches and appends the argmax after them. In torch that is
about twenty small operations, each a kernel launch and tens of microseconds of host time on the
step's critical path at batch 1; here it is one launch (through :class:`CachedLaunch`), one
program a request. :func:`pagoda.sample.rejection.rejection_sample` is the reference it must
equal (``tests/unit/test_greedy_verify_kernel.py``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch path runs instead
    triton = None

from pagoda.ops.launch import CachedLaunch

if triton is not None:
    # NOTE: nothing but the block is specialised (not the pointers' alignment, not k): one
    # compile per engine, made when its verification graphs are captured (``warm``).
    @triton.jit(
        do_not_specialize=[
            "argmax_ptr",
            "draft_ptr",
            "num_drafts_ptr",
            "starts_ptr",
            "tokens_ptr",
            "emitted_ptr",
            "num_rows",
            "K",
        ]
    )
    def _greedy_verify(
        argmax_ptr,  # [num_rows] int64: the target's argmax of each scored row
        draft_ptr,  # [n, K] int64
        num_drafts_ptr,  # [n] int64, <= K
        starts_ptr,  # [n] int64: each request's first scored row
        tokens_ptr,  # [n, K + 1] int64 out: accepted drafts, the argmax after them, then -1
        emitted_ptr,  # [n] int64 out: accepted drafts + 1
        num_rows,
        K,
        BLOCK: tl.constexpr,  # a power of two >= K + 1
    ):
        i = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        nd = tl.load(num_drafts_ptr + i)
        start = tl.load(starts_ptr + i)
        d = tl.load(draft_ptr + i * K + cols, mask=cols < K, other=-1)
        rows = tl.minimum(start + cols, num_rows - 1)
        a = tl.load(argmax_ptr + rows, mask=cols < K + 1, other=-1)
        # The first column that is no accepted draft: past the drafts, or a mismatch.
        miss = (cols >= nd) | (a != d)
        accepted = tl.min(tl.where(miss, cols, BLOCK), axis=0)
        final = tl.sum(tl.where(cols == accepted, a, 0), axis=0)
        out = tl.where(cols < accepted, d, tl.where(cols == accepted, final, -1))
        tl.store(tokens_ptr + i * (K + 1) + cols, out, mask=cols < K + 1)
        tl.store(emitted_ptr + i, accepted + 1)

    _launch = CachedLaunch(_greedy_verify)


def available(device: torch.device) -> bool:
    """Whether the rejection sampler takes this kernel for tensors on ``device``: CUDA, with
    Triton installed. (Its tests also run it on the CPU, interpreted.)"""
    return triton is not None and device.type == "cuda"


def greedy_verify(
    target_argmax: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    starts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample`` for all-greedy rows: ``(tokens [n, k + 1], num_emitted [n])``,
    int64, -1 past each request's emitted tokens."""
    n, k = draft_ids.shape
    dev = draft_ids.device
    tokens = torch.empty(n, k + 1, dtype=torch.int64, device=dev)
    emitted = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return tokens, emitted
    args = (
        target_argmax.long(),
        draft_ids.long().contiguous(),
        num_drafts.long().contiguous(),
        starts.long().contiguous(),
        tokens,
        emitted,
    )
    block = _block(k)
    _launch((n, block, dev.index), (n,), (*args, target_argmax.shape[0], k, block), num_warps=1)
    return tokens, emitted


def _block(k: int) -> int:
    # NOTE: at least 8 (k up to 7 in one compiled kernel), whatever this step's longest draft.
    return max(8, triton.next_power_of_2(k + 1))


def warm(device: torch.device, k: int) -> None:
    """Compile the kernel for drafts of up to ``k`` tokens now (start-up), not in a step."""
    if not available(device):
        return
    ids = torch.zeros(k + 1, dtype=torch.int64, device=device)
    greedy_verify(ids, ids[:k].view(1, k), ids[:1] + k, ids[:1])
