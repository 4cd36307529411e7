"""Launching a Triton kernel for a few microseconds of host time.

``kernel[grid](*args)`` binds and specialises its arguments and looks the compiled kernel up on
every call: tens of microseconds of Python, as much as some kernels run. A kernel launched once
or more a step on a host-bound engine (a grammar's bitmask, the wait for a matcher process), or
a few times a layer in an eager forward (a prefill's), pays that every time.

``CachedLaunch`` launches through the compiled kernel of the first JIT launch made with the
same ``key``, and with that launch's grid; the caller's key must hold the grid and everything
the JIT specialises on for those arguments (dtypes, the 16-byte alignment of pointers, the
value of integer arguments unless the kernel is declared with ``do_not_specialize`` for them),
and ``args`` must give every parameter of the kernel, constexprs included, in order.
``JitLaunch`` works the key out itself from the kernel's parameters and the call's arguments,
and launches at each call's grid: a drop-in for ``kernel[grid](...)``.

If the compiled kernel cannot be launched so (another Triton version's internals), the launch
falls back to the JIT for good and says so once at debug level.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

try:
    from triton.language import dtype as _triton_dtype
except ImportError:  # (no Triton: no kernel to launch, only the names)
    _triton_dtype = torch.dtype

logger = logging.getLogger(__name__)


class _Launches:
    """What both launchers keep: a cache by key of what the JIT's launches returned, which keys
    launched through it once, and whether the compiled kernels' launchers fit at all."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.fast = True  # False once the compiled kernel's launcher failed
        self._runners: dict[Hashable, Any] = {}
        self._tried: set[Hashable] = set()  # keys whose runner has launched once

    def _run(self, key: Hashable, runner: Any, args: tuple) -> bool:
        """Launch through ``runner``; False where its launcher does not fit (its first launch
        fails), and from then on every launch goes through the JIT."""
        if key in self._tried:
            runner(*args)
            return True
        try:
            runner(*args)
        except Exception as e:  # noqa: BLE001 - the JIT launch works, only slower
            self._give_up(e)
            return False
        self._tried.add(key)
        return True

    def _give_up(self, e: Exception) -> None:
        logger.debug("%s: launching through the JIT (%s)", getattr(self.fn, "__name__", ""), e)
        self.fast = False
        self._runners.clear()

    @property
    def num_cached(self) -> int:
        return len(self._runners)


class CachedLaunch(_Launches):
    """Launches through a runner of the compiled kernel at the grid of the key's first launch
    (the module's docstring)."""

    def __call__(self, key: Hashable, grid: tuple[int, ...], args: tuple, **options: Any) -> None:
        runner = self._runners.get(key) if self.fast else None
        if runner is not None and self._run(key, runner, args):
            return
        compiled = self.fn[grid](*args, **options)
        if not self.fast or compiled is None:
            return
        try:
            self._runners[key] = compiled[tuple(grid) + (1,) * (3 - len(grid))]
        except Exception as e:  # noqa: BLE001
            self._give_up(e)


def _arg_key(arg: Any, constexpr: bool) -> Hashable:
    """What the JIT could specialise ``arg`` on, or more: a constexpr's value; a tensor's dtype
    and whether its address is 16-byte aligned; an integer's range (32 or 64 bits), whether it
    is 1 and whether it is divisible by 16; a float's type; a string's or a dtype's value."""
    if constexpr:
        return (type(arg), arg)  # (True and 1 hash alike; the JIT tells them apart)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool) or arg is None:
        return (bool, arg)
    if isinstance(arg, (int, np.integer)):
        arg = int(arg)
        return (int, arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg < 2**63)
    if isinstance(arg, (float, np.floating)):
        return float
    if isinstance(arg, (str, torch.dtype, _triton_dtype)):
        return (type(arg), arg)
    # Anything else (a TMA descriptor, specialised on its block shape) goes through the JIT: a
    # key by identity would grow the cache by one entry a launch.
    raise TypeError(f"no launch key for a {type(arg).__name__}")


class JitLaunch(_Launches):
    """``JitLaunch(kernel)(grid, *args, **kwargs)`` launches like ``kernel[grid](*args,
    **kwargs)``: the first launch of a key through the JIT, the next ones through the compiled
    kernel it returned, at their own grid. The key is worked out here: the device, the launch
    options (``num_warps`` and the like) and :func:`_arg_key` of every argument, which holds at
    least what the JIT specialises that argument on, so two launches of one key run the same
    compiled kernel. That costs a few microseconds of Python a launch where the JIT's own
    binding and lookup cost tens: an eager forward (a prefill's) launches some six kernels a
    layer. The grid is not in the key (a prefill's grid follows its prompt's length). A kernel
    that does not describe its parameters (the interpreter's), a grid that is a function, or an
    argument that cannot be a key goes through the JIT; so does every launch once a compiled
    kernel's launcher has failed (another Triton version's internals), which is said once at
    debug level."""

    def __init__(self, fn: Any) -> None:
        super().__init__(fn)  # (its cache: key -> the compiled kernel, launched at any grid)
        params = getattr(fn, "params", None)
        self.names: tuple[str, ...] | None = None
        if params is not None:
            self.names = tuple(p.name for p in params)
            self.constexpr = tuple(bool(p.is_constexpr) for p in params)
            empty = inspect.Parameter.empty
            self.defaults = {p.name: p.default for p in params if p.default is not empty}

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        names = self.names
        if names is None or not self.fast or type(grid) is not tuple:
            self.fn[grid](*args, **kwargs)
            return
        options = dict(kwargs)
        try:
            full = args + tuple(
                options.pop(n) if n in options else self.defaults[n] for n in names[len(args) :]
            )
            device = next((a.device for a in full if isinstance(a, torch.Tensor)), None)
            key = (
                device,
                tuple(sorted(options.items())),
                tuple(map(_arg_key, full, self.constexpr)),
            )
            compiled = self._runners.get(key)
        except (KeyError, TypeError):  # (a parameter not given, or one that cannot be a key)
            self.fn[grid](*args, **kwargs)
            return
        if compiled is not None and self._run(key, compiled[grid + (1,) * (3 - len(grid))], full):
            return
        compiled = self.fn[grid](*full, **options)
        if self.fast and compiled is not None:
            self._runners[key] = compiled
