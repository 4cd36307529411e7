"""The engine gives its C heap's free memory back to the OS when it goes idle after work."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import pytest

from pagoda.engine.heap import HeapTrimmer, _malloc_trim


def test_the_first_idle_after_work_trims_once() -> None:
    calls = []
    heap = HeapTrimmer(trim=lambda pad: calls.append(pad) or 1)
    heap.idle()
    assert calls == []  # nothing done yet, nothing to give back
    heap.worked()
    heap.worked()
    heap.idle()
    heap.idle()
    assert calls == [0] and heap.trims == 1
    heap.worked()
    heap.idle()
    assert calls == [0, 0] and heap.trims == 2


def test_a_failing_trim_is_dropped_not_raised() -> None:
    def broken(pad: int) -> int:
        raise OSError("no")

    heap = HeapTrimmer(trim=broken)
    heap.worked()
    heap.idle()
    heap.worked()
    heap.idle()  # not called again
    assert heap.trims == 0


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


@pytest.mark.skipif(_malloc_trim() is None, reason="needs glibc's malloc_trim")
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_trimming_returns_freed_heap_pages_to_the_os() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunk = 64 << 10  # below the mmap threshold: from the heap, as a runner's small tensors
    blocks = [libc.malloc(chunk) for _ in range(1600)]  # 100 MiB
    for b in blocks:
        ctypes.memset(b, 1, chunk)  # resident
    for b in blocks[:-1]:  # the last one pins the heap's top: nothing is released by free
        libc.free(b)
    before = _rss_anon()
    heap = HeapTrimmer()
    heap.worked()
    heap.idle()
    after = _rss_anon()
    libc.free(blocks[-1])
    assert heap.trims == 1
    assert before - after > 50 << 20, (before >> 20, after >> 20)
