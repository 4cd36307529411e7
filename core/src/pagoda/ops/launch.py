"""Launching a small Triton kernel every step for a few microseconds of host time.

``kernel[grid](*args)`` binds and specialises its arguments and looks the compiled kernel up on
every call: tens of microseconds of Python, as much as some kernels run. A kernel launched once
or more a step on a host-bound engine (a grammar's bitmask, the wait for a matcher process) pays
that every step. ``CachedLaunch`` launches through the compiled kernel of the first JIT launch
made with the same ``key``, and with that launch's grid; the caller's key must hold the grid
and everything the JIT specialises on for
those arguments (dtypes, the 16-byte alignment of pointers, the value of integer arguments
unless the kernel is declared with ``do_not_specialize`` for them), and ``args`` must give every
parameter of the kernel, constexprs included, in order.

If the compiled kernel cannot be launched so (another Triton version's internals), the launch
falls back to the JIT for good and says so once at debug level.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

logger = logging.getLogger(__name__)


class CachedLaunch:
    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.fast = True  # False once the compiled kernel's launcher failed
        self._runners: dict[Hashable, Any] = {}
        self._tried: set[Hashable] = set()  # keys whose runner has launched once

    def __call__(self, key: Hashable, grid: tuple[int, ...], args: tuple, **options: Any) -> None:
        runner = self._runners.get(key) if self.fast else None
        if runner is not None:
            if key in self._tried:
                runner(*args)
                return
            try:  # the first launch through it: a launcher that does not fit fails here
                runner(*args)
                self._tried.add(key)
                return
            except Exception as e:  # noqa: BLE001 - the JIT launch works, only slower
                self._give_up(e)
        compiled = self.fn[grid](*args, **options)
        if not self.fast or compiled is None:
            return
        try:
            self._runners[key] = compiled[tuple(grid) + (1,) * (3 - len(grid))]
        except Exception as e:  # noqa: BLE001
            self._give_up(e)

    def _give_up(self, e: Exception) -> None:
        logger.debug("%s: launching through the JIT (%s)", getattr(self.fn, "__name__", ""), e)
        self.fast = False
        self._runners.clear()

    @property
    def num_cached(self) -> int:
        return len(self._runners)
