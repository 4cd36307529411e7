"""Host memory for the KV cache on a CPU: how much there is, and zeroed tensors that cost nothing
until they are written."""

from __future__ import annotations

import math
import mmap
import os

import torch


def available_memory_bytes() -> int:
    """Memory the system can give this process now without swapping (Linux ``MemAvailable``,
    else free pages, else the total)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil  # NOTE: optional (not a dependency): imported only where /proc is not

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    for name in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            return int(os.sysconf(name)) * page
        except (ValueError, OSError):
            continue
    raise RuntimeError("cannot tell how much memory this machine has")


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros over an anonymous memory map: the OS hands out zeroed pages when
    they are first touched, so there is no fill pass and the memory is committed only as it is
    written. Reads of never-written slots (masked cache tails, block 0) see zeros, as with
    ``torch.zeros``."""
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)
    buf = mmap.mmap(-1, nbytes)
    # NOTE: frombuffer keeps the map alive for as long as the tensor lives.
    return (
        torch.frombuffer(buf, dtype=torch.uint8)[: math.prod(shape) * dtype.itemsize]
        .view(dtype)
        .view(shape)
    )
