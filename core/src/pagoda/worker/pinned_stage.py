"""Page-locked staging for the small host-to-device copies of every step.

A step copies its index arrays (input ids, positions, slots, block tables, the sampler's and the
verifier's indices) to the device without making the host wait, which needs page-locked host
memory. ``Tensor.pin_memory()`` per array costs tens of microseconds of host time (an allocation
from the caching host allocator, its bookkeeping), a handful of times a step; at batch 1 that is
host time on the critical path. ``PinnedStage`` keeps two page-locked regions and hands out
slices of one of them: each launch takes the other region (``next_launch``), which the launch
before the last one used, and first waits for an event recorded when that region was left (long
passed: the engine reads a step's output before the launch after next).
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64


class PinnedStage:
    def __init__(self, nbytes: int = 4 << 20, regions: int = 2) -> None:
        self._buf = [
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(regions)
        ]
        self._np = [b.numpy() for b in self._buf]
        # Recorded when each region was last left (re-recorded each time: no event per launch;
        # one never recorded has passed).
        self._left = [torch.cuda.Event() for _ in range(regions)]
        self._i = 0
        self._off = 0

    def next_launch(self) -> None:
        """A new launch: switch regions. Copies from the region left may still be queued; an
        event marks them, and the region is reused only once that event has passed (it has:
        the step launched before them was read, so checking costs no wait)."""
        self._left[self._i].record()
        self._i = (self._i + 1) % len(self._buf)
        if not self._left[self._i].query():
            self._left[self._i].synchronize()
        self._off = 0

    def host(self, src: np.ndarray) -> torch.Tensor | None:
        """A page-locked host tensor holding ``src`` (the launch's region), or None where the
        region is full (the caller pins its own)."""
        src = np.ascontiguousarray(src)
        n = src.nbytes
        off = self._off
        if n == 0 or off + n > self._np[self._i].shape[0]:
            return None
        self._off = (off + n + _ALIGN - 1) // _ALIGN * _ALIGN
        self._np[self._i][off : off + n].view(src.dtype).reshape(src.shape)[...] = src
        return self._buf[self._i][off : off + n].view(_TORCH[src.dtype]).view(src.shape)


_TORCH = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float16): torch.float16,
}

STAGED_DTYPES = frozenset(_TORCH)
