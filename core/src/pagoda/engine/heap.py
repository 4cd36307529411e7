"""Giving the C heap's free memory back to the operating system when the engine goes idle.

The model runner's tensors change shape with every batch (rows, tokens, blocks), and glibc's
allocator keeps what they free in its arenas for reuse: after a burst of traffic an engine on a
CPU holds tens of MiB it no longer uses (37 MiB of 223 on the tiny test model), and how much
depends on the mix of shapes it saw, so its RSS wanders up and down with the traffic instead of
showing what it really keeps. ``malloc_trim(0)`` returns the free pages; the engine calls it once
each time it has been idle for a poll interval after doing work, when a few milliseconds cost
nobody anything.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """``worked()`` after each step; ``idle()`` when the engine has nothing to do: the first
    ``idle()`` after work trims the heap, later ones do nothing until there is work again."""

    def __init__(self, trim: Callable[[int], int] | None = None) -> None:
        self._trim = trim if trim is not None else _malloc_trim()
        self._dirty = False
        self.trims = 0

    def worked(self) -> None:
        self._dirty = True

    def idle(self) -> None:
        if not self._dirty or self._trim is None:
            return
        self._dirty = False
        try:
            self._trim(0)
        except Exception:  # never worth failing the engine for
            logger.debug("malloc_trim failed", exc_info=True)
            self._trim = None
            return
        self.trims += 1
