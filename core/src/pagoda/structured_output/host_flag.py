"""The device waits for a number the host writes, so that the host does not wait for it.

The grammar matcher process (``pagoda.structured_output.remote``) fills a step's bitmask rows in
shared pinned memory, then writes that step's number into a pinned flag. Rather than have the
engine's host thread wait for the fill before it launches the sampling that applies the mask,
the host enqueues ``wait_for(flag, seq)`` on the stream ahead of the mask's copy: one program
that spins on the flag over the bus until it reaches ``seq``. The host goes on to the next launch
at once; only the device waits, and only if the fill is late.

NOTE: one program, and the rows then cross the bus by the copy engine. Many programs polling one
host address are served one read at a time (an H200 took 12 ms a step with 2,432 programs), and
a program reading a row's words from host memory pays the bus's latency per block.

A flag that never comes (the child died, or hangs) must not hang the device: the spin is
bounded by ``timeout_s`` of the device's own clock (``%globaltimer``), after which the kernel
writes a non-zero error word and lets the stream go on; the runner checks the word each step and
fails with the matcher process's error rather than sample with a stale mask. (A bound counted in
polls, at a nominal microsecond a poll, ran out on an H200 within a kernel's first compile: a
poll of host memory takes far less.)
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


from pagoda.ops.launch import CachedLaunch

if triton is not None:

    @triton.jit(do_not_specialize=["seq"])
    def _spin_until(flag_ptr, error_ptr, seq, timeout_ns):
        start = globaltimer()
        value = tl.load(flag_ptr, volatile=True)
        while (value < seq) & (globaltimer() - start < timeout_ns):
            value = tl.load(flag_ptr, volatile=True)
        if value < seq:
            tl.store(error_ptr, seq)


def device_wait_available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def wait_for(flag: torch.Tensor, error: torch.Tensor, seq: int, timeout_s: float = 30.0) -> None:
    """Enqueue on the current stream: wait until ``flag[0] >= seq``. ``flag`` and ``error`` are
    int64 tensors in page-locked host memory the device can address (``cudaHostRegister`` or
    ``pin_memory``); on timeout ``error[0]`` becomes ``seq``."""
    # NOTE: a launch every constrained step: through the compiled kernel (see pagoda.ops.launch)
    key = (flag.data_ptr(), error.data_ptr(), seq > 0x7FFFFFFF, timeout_s)  # seq: i32 or i64
    _launch(key, (1,), (flag, error, seq, int(timeout_s * 1e9)), num_warps=1)


_launch = CachedLaunch(_spin_until) if triton is not None else None
