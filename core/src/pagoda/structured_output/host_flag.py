"""The device waits for a number the host writes, so that the host does not wait for it.

The grammar matcher process (``pagoda.structured_output.remote``) fills a step's bitmask rows in
shared pinned memory, then writes that step's number into a pinned flag. Rather than have the
engine's host thread wait for the fill before it launches the sampling that applies the mask,
the host enqueues ``wait_for(flag, seq)`` on the stream ahead of the mask's copy: one program
that spins on the flag over the bus until it reaches ``seq``. The host goes on to the next launch
at once; only the device waits, and only if the fill is late.

A flag that never comes (the child died, or hangs) must not hang the device: the spin is
bounded (about ``timeout_s``), after which the kernel writes a non-zero error word and lets the
stream go on; the runner checks the word each step and fails with the matcher process's error
rather than sample with a stale mask.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


if triton is not None:

    @triton.jit
    def _spin_until(flag_ptr, error_ptr, seq, max_polls):
        i = 0
        value = tl.load(flag_ptr, volatile=True)
        while (value < seq) & (i < max_polls):
            value = tl.load(flag_ptr, volatile=True)
            i += 1
        if value < seq:
            tl.store(error_ptr, seq)

    @triton.jit
    def _wait_then_mask(
        flag_ptr,
        error_ptr,
        seq,
        max_polls,
        bitmask_ptr,  # [rows, words] int32 in host memory
        bitmask_stride,
        logits_ptr,  # [rows, vocab] float32 on the device
        logits_stride,
        vocab,
        words,
        WORDS: tl.constexpr,
    ):
        # One program per (row, WORDS words): every program reads its own words over the bus at
        # once, so the rows cross it in parallel (a program looping over a row's words would pay
        # the bus's latency once per block).
        row = tl.program_id(0)
        w = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
        i = 0
        value = tl.load(flag_ptr, volatile=True)
        while (value < seq) & (i < max_polls):
            value = tl.load(flag_ptr, volatile=True)
            i += 1
        if value < seq:
            tl.store(error_ptr, seq)
        else:
            # NOTE: .cv: fetch again; the host rewrote these lines since the last read.
            word = tl.load(
                bitmask_ptr + row * bitmask_stride + w,
                mask=w < words,
                other=-1,
                cache_modifier=".cv",
            )
            bits = tl.arange(0, 32)
            refused = ((word[:, None] >> bits[None, :]) & 1) == 0
            token = w[:, None] * 32 + bits[None, :]
            tl.store(
                logits_ptr + row * logits_stride + token,
                float("-inf"),
                mask=refused & (token < vocab),
            )


_WORDS = 128  # bitmask words (4,096 tokens) a program masks

# One poll of a flag in host memory crosses the bus: about a microsecond (measured on PCIe 5).
_POLL_S = 1e-6


def device_wait_available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def wait_for(flag: torch.Tensor, error: torch.Tensor, seq: int, timeout_s: float = 30.0) -> None:
    """Enqueue on the current stream: wait until ``flag[0] >= seq``. ``flag`` and ``error`` are
    int64 tensors in page-locked host memory the device can address (``cudaHostRegister`` or
    ``pin_memory``); on timeout ``error[0]`` becomes ``seq``."""
    _spin_until[(1,)](flag, error, seq, int(timeout_s / _POLL_S), num_warps=1)


def wait_then_mask(
    flag: torch.Tensor,
    error: torch.Tensor,
    seq: int,
    bitmask: torch.Tensor,
    logits: torch.Tensor,
    timeout_s: float = 30.0,
) -> None:
    """Enqueue on the current stream: wait until ``flag[0] >= seq``, then set to -inf every
    logit of ``logits`` (``[n, vocab]`` float32, on the device) that ``bitmask`` (``[n, words]``
    int32 in the standard layout, in registered host memory, read in place) refuses. One launch
    for the wait, the bitmask's trip over the bus and its application. On timeout the logits are
    left alone and ``error[0]`` becomes ``seq``."""
    n, vocab = logits.shape
    words = bitmask.shape[1]
    _wait_then_mask[(n, triton.cdiv(words, _WORDS))](
        flag,
        error,
        seq,
        int(timeout_s / _POLL_S),
        bitmask,
        bitmask.stride(0),
        logits,
        logits.stride(0),
        vocab,
        words,
        WORDS=_WORDS,
        num_warps=4,
    )
