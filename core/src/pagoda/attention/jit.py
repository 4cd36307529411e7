"""Just-in-time kernel compiles of attention backends, run in child processes.

A backend whose kernels compile on first use (FlashInfer: about a minute on a fresh machine) says
so through ``is_compiled`` and gives the command that compiles them (``compile_command``). With
``attention.backend: auto`` the engine starts on a backend that is ready and runs that command in
the background, so the first request does not wait and the next start finds the kernels built;
a backend named explicitly compiles before the first step. Either way the log says what is
compiling and how long it took, with the lines the command printed last (what it built). A
compile runs in its own process group, and a stopped one is stopped whole: a compiler left
running would finish writing into the cache after the next compile had recorded it, which the
build tool then finds out of date and rebuilds on a later start.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

_running: list[subprocess.Popen] = []
_started: dict[tuple[str, ...], threading.Thread] = {}  # argv -> its watcher, once a process
_lock = threading.Lock()


def _niced() -> None:
    os.nice(10)  # NOTE: runs in the child, before exec: the engine keeps the CPU first.


def _spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_niced,
        start_new_session=True,  # its own process group: the compilers it starts stop with it
    )


def _stop(proc: subprocess.Popen) -> None:
    """Stop ``proc`` and its process group: SIGTERM, then SIGKILL to what is left after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            proc.poll()  # reaps the leader once it is gone
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def _tail(text: str | None, lines: int = 20) -> str:
    return "\n".join((text or "").strip().splitlines()[-lines:])


def _log_said(out: str | None) -> None:
    for line in _tail(out, 12).splitlines():
        if line.strip():
            logger.info("attention: %s", line.strip())


def compile_now(backend: Any, what: str, argv: list[str]) -> bool:
    """Run ``argv`` (``backend``'s compile command) and wait for it; returns whether it exited 0.
    A failed compile is logged, not raised: the backend then compiles on its first step."""
    logger.info(
        "attention: compiling %s's kernels for %s before the first step", backend.name, what
    )
    start = time.perf_counter()
    proc = _spawn(argv)
    try:
        out, _ = proc.communicate()
    except BaseException:  # NOTE: Ctrl-C does not reach the child's own process group.
        _stop(proc)
        raise
    took = time.perf_counter() - start
    if proc.returncode == 0:
        _log_said(out)
        logger.info("attention: %s's kernels for %s compiled in %.1f s", backend.name, what, took)
        return True
    logger.warning(
        "attention: compiling %s's kernels for %s failed after %.1f s (exit %s); they compile "
        "on the first step instead:\n%s",
        backend.name,
        what,
        took,
        proc.returncode,
        _tail(out),
    )
    return False


def compile_in_background(backend: Any, what: str, argv: list[str]) -> threading.Thread:
    """Start ``argv`` (``backend``'s compile command) in a child process and return the thread
    that waits for it and logs the outcome. The child is stopped if this process exits first.
    The same command is started once a process; a second call returns the first's thread."""
    with _lock:
        if tuple(argv) in _started:
            return _started[tuple(argv)]
        start = time.perf_counter()
        proc = _spawn(argv)
        _running.append(proc)

    def watch() -> None:
        out, _ = proc.communicate()
        took = time.perf_counter() - start
        with _lock:
            if proc in _running:
                _running.remove(proc)
        if proc.returncode == 0:
            _log_said(out)
            logger.info(
                "attention: %s's kernels for %s compiled in the background in %.1f s; the next "
                "engine start uses %s",
                backend.name,
                what,
                took,
                backend.name,
            )
        elif proc.returncode is not None and proc.returncode < 0:
            logger.info("attention: background compile of %s stopped at exit", backend.name)
        else:
            logger.warning(
                "attention: background compile of %s's kernels for %s failed after %.1f s "
                "(exit %s):\n%s",
                backend.name,
                what,
                took,
                proc.returncode,
                _tail(out),
            )

    thread = threading.Thread(target=watch, name=f"compile-{backend.name}", daemon=True)
    with _lock:
        _started[tuple(argv)] = thread
    thread.start()
    return thread


def wait_for_background_compiles(timeout: float | None = None) -> bool:
    """Wait until every compile this process started in the background has ended (built,
    failed or stopped), ``timeout`` seconds at most in all; returns whether one had been started.
    A benchmark or a test that measures the engine as it serves once its kernels are built waits
    for them, then starts its engine again: an ``auto`` engine started before they were built
    runs on another backend until its next start."""
    with _lock:
        threads = list(_started.values())
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return bool(threads)


@atexit.register
def stop_background_compiles() -> None:
    """Stop the background compiles still running, each with the compilers it started (at exit:
    no child outlives the engine)."""
    with _lock:
        procs = list(_running)
    start = time.perf_counter()
    for proc in procs:
        _stop(proc)
    if procs:
        took = time.perf_counter() - start
        logger.info("attention: background compiles and their compilers stopped in %.1f s", took)
