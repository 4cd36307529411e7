"""An engine process's life: Python's garbage collector in the engine loop, dying with the
parent, and ending without the interpreter's teardown (:func:`run_then_end_quietly`).

Every step allocates a few objects per request (outputs, token lists, scheduler records), so the
collector runs its youngest generation several times a step at large batches, and now and then
a full collection walks every object the process holds: the model's modules, the caches, the
captured graphs, the tokenizer. Those pauses land inside steps, where the host work is what sets
the pace for a small model (`benchmarks/host_overhead.py`, 256 requests on a tiny model: about
1.5 ms of a 12 ms step in the collector as Python sets it, 0.03 ms tuned).

:func:`tune_gc` is for a process that runs one engine for the rest of its life (the engine-core
process of ``pagoda serve`` and ``AsyncLLM``, a tensor-parallel worker process): it collects
once, freezes what is alive (the collector never walks it again) and lets the youngest
generation grow to ``gen0`` objects before it is collected. :func:`tuned_gc` does the same for a
while and undoes it, for a process that goes on to other work (a benchmark). An engine built by
``LLM(...)`` in a user's process does not freeze for good: frozen objects are never collected,
and an engine dropped without ``shutdown()`` would keep its reference cycles (and the device
memory they hold) for good. Its batch calls freeze for their own length (:func:`steps_gc`),
which took about 1 ms off the host's work before an embedding call's first step (256 prompts
of 512 tokens, a 2-core CPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

#: Allocations (less deallocations) before the youngest generation is collected; Python's
#: default is 700 (2000 from 3.13).
GEN0 = 10_000


#: Whether :func:`tune_gc` froze the process's objects (and :func:`tuned_gc` has not undone it).
#: NOTE: kept here because ``gc.get_freeze_count()`` counts the frozen objects one by one: tens
#: of milliseconds in a process that froze its model, torch and the tokenizer, which a batch
#: call of ``LLM`` paid each time it asked (most of a short request's host time at batch 1).
_tuned = [False]


def tune_gc(gen0: int = GEN0) -> tuple[int, int, int]:
    """Collect, freeze the survivors, and raise the youngest generation's threshold to ``gen0``
    (a higher one, or a collector turned off, stays). Returns the thresholds before."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    _tuned[0] = True
    t0, t1, t2 = before
    if 0 < t0 < gen0:
        gc.set_threshold(gen0, t1, t2)
    return before


@contextmanager
def tuned_gc(gen0: int = GEN0) -> Iterator[None]:
    """:func:`tune_gc` inside the block; after it, the frozen objects are collectable again and
    the thresholds are what they were."""
    before = tune_gc(gen0)
    try:
        yield
    finally:
        gc.unfreeze()
        _tuned[0] = False
        gc.set_threshold(*before)


@contextmanager
def steps_gc(gen0: int = GEN0) -> Iterator[None]:
    """For a batch call's steps in a user's process (``LLM.generate``, ``LLM.embed``): what is
    alive when it starts stays frozen until it returns (the collections during the call walk
    only what the call made, not the model, the caches and every imported module), and the
    youngest generation grows to ``gen0`` meanwhile; then everything is collectable again and
    the thresholds are back. Unlike :func:`tune_gc` it collects nothing first (a full
    collection costs milliseconds a call): garbage from before the call waits for a collection
    after it. Where :func:`tune_gc` froze the process already, it leaves the freeze as it is and
    only raises the threshold; with the collector off it does nothing.

    NOTE: objects frozen by other code (a ``gc.freeze()`` of the user's own) are unfrozen with
    the call's when it returns: telling them apart would cost a walk over every frozen object
    at each call (``gc.get_freeze_count()``)."""
    if not gc.isenabled():
        yield
        return
    before = gc.get_threshold()
    freeze = not _tuned[0]
    if freeze:
        gc.freeze()
    if 0 < before[0] < gen0:
        gc.set_threshold(gen0, *before[1:])
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        gc.set_threshold(*before)


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies, so no engine outlives its server."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def run_then_end_quietly(main: Callable[..., Any], *args: Any) -> NoReturn:
    """Run an engine child process's ``main(*args)``, then end the process without the
    interpreter's teardown, with ``main``'s exit status (``sys.exit`` included).

    NOTE: Triton's compiler library (nanobind) prints a "nanobind: leaked ..." line on stderr for
    each of its objects still alive at teardown: over a hundred when ``pagoda serve`` stops a GPU
    engine. ``main`` has released what it holds (sockets, workers, the device) by the time it
    returns, so nothing is lost by skipping the teardown; stdio and logging are flushed first.
    A fork-started child of ``multiprocessing`` ends the same way."""
    code = 0
    try:
        main(*args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
