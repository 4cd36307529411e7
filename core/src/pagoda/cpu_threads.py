"""How many CPU threads an engine process gives torch (and OpenMP), and how they wait.

torch sizes its pool to every core of the host and OpenMP's threads spin for a while after each
parallel region. On a machine the engine shares (a 2-core CI runner with a test or a second
engine busy, the tensor-parallel ranks of one engine) the spinning threads take the cores the
others need, and each step waits for the slowest thread: six requests of 40 tokens on SmolLM2
took 74.3 s with torch's default threads beside a busy process, 8.3 s with one thread (the
figures on the CI machine are in the README's CPU notes).

So each engine process takes its share of the CPUs its affinity mask allows, divided among the
engine processes that compute on them (the tensor-parallel ranks), a quarter of that on a GPU
engine (its host work is scheduling and small copies); OpenMP's threads sleep when idle
(``OMP_WAIT_POLICY=PASSIVE``) unless the environment says otherwise. ``model.cpu_threads``,
``OMP_NUM_THREADS`` (the name torch reads) or vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` (its count of
CPUs) chooses the count instead.

NOTE: the wait policy is read once, when OpenMP loads with torch: :func:`set_wait_policy` runs
before the command line, ``LLM`` or ``AsyncLLM`` import torch, and the engine's child processes
inherit it. A process that imported torch before Pagoda keeps the policy it started with.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

WAIT_POLICY = "PASSIVE"


def allowed_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def choose_threads(
    cpus: int,
    processes: int = 1,
    gpu: bool = False,
    configured: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """``(threads, why)`` for one engine process: ``configured`` (``model.cpu_threads``) if
    set, else ``OMP_NUM_THREADS`` or the CPUs ``VLLM_CPU_OMP_THREADS_BIND`` lists from
    ``environ``, else ``cpus`` (the affinity mask's size)
    shared among ``processes`` engine processes, a quarter of the share for a ``gpu`` engine;
    at least 1. ``why`` says which rule chose, for the log."""
    environ = os.environ if environ is None else environ
    if configured is not None:
        return max(1, configured), "model.cpu_threads"
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    bound = _bound_cpus(environ.get("VLLM_CPU_OMP_THREADS_BIND", ""))
    if bound:
        return bound, "VLLM_CPU_OMP_THREADS_BIND"
    share = max(1, cpus // max(1, processes))
    why = f"{cpus} CPUs allowed" + (f", {processes} engine processes" if processes > 1 else "")
    if gpu:
        return max(1, share // 4), why + ", a quarter for a GPU engine's host work"
    return share, why


def _bound_cpus(spec: str) -> int:
    """The CPUs vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` lists for one process (``0-3,6``; ranks
    separated by ``|``: the first rank's), 0 when it lists none (unset, ``auto``, ``nobind``)."""
    first = spec.split("|")[0].strip()
    count = 0
    for part in filter(None, (p.strip() for p in first.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return 0
        count += int(hi) - int(lo) + 1 if hi else 1
    return max(count, 0)


def set_wait_policy(environ: dict[str, str] | None = None) -> str:
    """Make OpenMP's idle threads sleep rather than spin (``OMP_WAIT_POLICY=PASSIVE``) unless
    the environment already chooses; returns the policy in force. Call before torch loads."""
    environ = os.environ if environ is None else environ
    return environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
