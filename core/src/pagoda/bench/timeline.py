"""Where a call's time went on a GPU: the device's busy and idle time under torch's profiler, and
what the host was doing while the device waited.

:func:`annotated` wraps methods of the engine (the scheduler's, the executor's, the model
runner's) in profiler ranges named ``PREFIX + label``; :func:`device_timeline` reads the
profiler's events of one call: the device's busy time (the union of its kernels and copies), its
idle time between its first kernel and its last, and that idle time split by the innermost
annotated range the host was in (``idle_by_host``): the host work that the device waited for,
which is the host's share of the call's critical path. Idle time outside every range is
``(unannotated)``. :func:`timed` wraps the same way with a clock instead of ranges.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

PREFIX = "pagoda.timeline."


@contextlib.contextmanager
def wrapped(targets: list[tuple[Any, str, str]], wrap: Callable[[str, Any], Any]) -> Iterator[None]:
    """Each ``(owner, attribute, label)``'s callable (a method of an object or a class, or a
    module's function) is ``wrap(label, callable)`` while the block runs; owners that are None
    or lack the attribute are left out."""
    saved = []
    for owner, attr, label in targets:
        if owner is None or not hasattr(owner, attr):
            continue
        own = attr in getattr(owner, "__dict__", {})
        saved.append((owner, attr, own, owner.__dict__.get(attr) if own else None))
        setattr(owner, attr, wrap(label, getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr, own, old in reversed(saved):
            if own:
                setattr(owner, attr, old)
            else:
                delattr(owner, attr)  # (the class's attribute again)


def annotated(
    targets: list[tuple[Any, str, str]], prefix: str = PREFIX
) -> contextlib.AbstractContextManager[None]:
    """Each target (:func:`wrapped`) runs inside a profiler range ``prefix + label``."""
    from torch.profiler import record_function

    def ranged(label: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            with record_function(prefix + label):
                return fn(*a, **k)

        return call

    return wrapped(targets, ranged)


def timed(
    targets: list[tuple[Any, str, str]], record: Callable[[str, int, int], None]
) -> contextlib.AbstractContextManager[None]:
    """Each target (:func:`wrapped`) calls ``record(label, start_ns, end_ns)`` when it returns
    (``time.perf_counter_ns``; no profiler, whose own cost would swamp calls of microseconds)."""

    def timing(label: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                record(label, t, time.perf_counter_ns())

        return call

    return wrapped(targets, timing)


def device_timeline(events: Any, call: str, top: int = 12) -> dict[str, Any]:
    """The timeline of the profiler range named ``call`` from ``events`` (``prof.events()``),
    in ms from the range's start: ``wall_ms``, ``device_busy_ms``, ``device_idle_ms`` (between
    the first kernel and the last), ``first_kernel_ms``, ``tail_ms`` (from the last kernel's end
    to the range's end), ``idle_by_host`` ([label, ms], largest first) and ``kernels`` (the
    ``top`` device kernels by total time, with their counts)."""
    import torch

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    span = next(e for e in events if e.name == call and e.device_type == cpu)
    start, end = span.time_range.start, span.time_range.end
    device = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        # (annotations are on the device's timeline too: they are not work)
        if e.device_type == cuda
        and e.name != call
        and not e.name.startswith(PREFIX)
        and start <= e.time_range.start <= end
    )
    ranges = sorted(
        (e.time_range.start, e.time_range.end, e.name[len(PREFIX) :])
        for e in events
        if e.device_type == cpu and e.name.startswith(PREFIX)
    )
    out: dict[str, Any] = {"wall_ms": round((end - start) / 1e3, 3)}
    if not device:
        return out
    busy, hi, gaps = busy_and_gaps(device)
    idle: dict[str, float] = {}
    for a, b, _ in gaps:
        for label, us in _split(ranges, a, b):
            idle[label] = idle.get(label, 0.0) + us
    kernels: dict[str, list[float]] = {}
    for s, e, name in device:
        k = kernels.setdefault(name[:90], [0.0, 0])
        k[0] += e - s
        k[1] += 1
    out.update(
        device_busy_ms=round(busy / 1e3, 3),
        device_idle_ms=round((hi - device[0][0] - busy) / 1e3, 3),
        first_kernel_ms=round((device[0][0] - start) / 1e3, 3),
        tail_ms=round((end - hi) / 1e3, 3),
        idle_by_host=[
            [label, round(us / 1e3, 3)] for label, us in sorted(idle.items(), key=lambda x: -x[1])
        ],
        kernels=[
            {"name": name, "ms": round(t / 1e3, 3), "count": n}
            for name, (t, n) in sorted(kernels.items(), key=lambda x: -x[1][0])[:top]
        ],
    )
    return out


def busy_and_gaps(
    spans: list[tuple[int, int, str]],
) -> tuple[int, int, list[tuple[int, int, str]]]:
    """Over ``spans`` (``(start, end, name)``, sorted by start, at least one): the time their
    union covers, where it ends, and each gap in it as ``(gap start, gap end, name of the span
    after it)``."""
    busy, lo, hi = 0, spans[0][0], spans[0][1]
    gaps = []
    for s, e, name in spans[1:]:
        if s > hi:
            busy += hi - lo
            gaps.append((hi, s, name))
            lo = s
        hi = max(hi, e)
    return busy + hi - lo, hi, gaps


def _split(ranges: list[tuple[int, int, str]], a: int, b: int) -> list[tuple[str, float]]:
    """``[a, b]`` cut where annotated ranges begin or end, each piece labelled by the innermost
    range spanning it (the last begun)."""
    inside = [r for r in ranges if r[0] < b and r[1] > a]
    cuts = sorted({a, b, *(t for s, e, _ in inside for t in (s, e) if a < t < b)})
    pieces = []
    for lo, hi in zip(cuts, cuts[1:]):
        mid = (lo + hi) / 2
        over = [r for r in inside if r[0] <= mid <= r[1]]
        pieces.append((over[-1][2] if over else "(unannotated)", hi - lo))
    return pieces
