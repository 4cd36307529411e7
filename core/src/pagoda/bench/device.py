"""What a device can move: timing on the device's own clock, and its copy bandwidth."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def time_fn(fn: Callable[[], Any], iters: int, device: Any) -> float:
    """Seconds per call of ``fn``, after one untimed call; CUDA events on a GPU."""
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch

    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1000 / iters


def graph_time(fn: Callable[[], Any], device: Any, calls: int = 1, iters: int = 10) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls, as decode steps
    run (no launch overhead, which at small sizes is longer than the kernels themselves); one
    eager call first compiles and warms up."""
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch

    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_fn(graph.replay, iters, device) / calls


def copy_bandwidth(device: Any, nbytes: int | None = None, iters: int = 20) -> float:
    """Bytes per second of a large copy on ``device``, counting what it reads and what it writes.

    1 GiB on a GPU, 256 MiB on a CPU unless ``nbytes`` says otherwise: large enough that caches
    do not serve it.
    """
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch

    if nbytes is None:
        nbytes = 1 << 30 if device.type == "cuda" else 256 << 20
    seconds = _copy_seconds(device, nbytes, iters)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # an engine started next sizes its KV cache from free memory
    return 2 * nbytes / seconds


def _copy_seconds(device: Any, nbytes: int, iters: int) -> float:
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch

    x = torch.ones(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return time_fn(lambda: y.copy_(x), iters, device)


class KernelCompiles:
    """Triton kernels compiled (or loaded from the disk cache) while it is entered: a timed
    region should meet none, or a first-time cost is in the figure. ``names`` in order;
    ``details`` the same compiles with the variant Triton built (its launch options and each
    argument's specialization, constexpr values included) and ``where`` as the caller had set
    it then (which pass met it); ``supported`` is False where this Triton offers no compile
    hook (or there is no Triton)."""

    def __init__(self) -> None:
        self.details: list[dict[str, Any]] = []
        self.where: str | None = None
        self.supported = False
        self._knobs: Any = None
        self._before: Any = None

    def __enter__(self) -> KernelCompiles:
        try:
            import triton.knobs as knobs

            self._knobs = knobs.runtime
            self._before = self._knobs.jit_post_compile_hook
        except (ImportError, AttributeError):
            return self
        self.supported = True

        def hook(*args: Any, **kwargs: Any) -> None:
            fn = kwargs.get("fn")
            variant = kwargs.get("repr")
            self.details.append(
                {
                    "kernel": str(getattr(fn, "name", None) or getattr(fn, "__name__", fn)),
                    "where": self.where,
                    "variant": None if variant is None else str(variant),
                    "constexprs": _constexprs(fn, kwargs.get("compile")),
                }
            )
            if self._before is not None:
                self._before(*args, **kwargs)

        self._knobs.jit_post_compile_hook = hook
        return self

    @property
    def names(self) -> list[str]:
        return [d["kernel"] for d in self.details]

    def __exit__(self, *exc: object) -> None:
        if self.supported:
            self._knobs.jit_post_compile_hook = self._before


def _constexprs(fn: Any, compiled: Any) -> dict[str, str] | None:
    """The compile's constexpr values by parameter name (what tells one variant of a kernel
    from another), or None where this Triton's hook does not pass them."""
    constants = compiled.get("constants") if isinstance(compiled, dict) else None
    if not isinstance(constants, dict):
        return None
    params = getattr(getattr(fn, "jit_function", None), "params", None) or []
    names = [getattr(p, "name", str(i)) for i, p in enumerate(params)]
    got = {}
    for key, value in constants.items():
        i = key[0] if isinstance(key, tuple) and key else key
        name = names[i] if isinstance(i, int) and i < len(names) else str(key)
        got[name] = str(value)
    return got


# Throttle reasons (NVML's ``clocks_event_reasons``) in nvidia-smi's bit mask: power and heat.
_POWER_CAP = 0x4 | 0x80  # the software power cap, the hardware power brake
_THERMAL = 0x20 | 0x40  # software and hardware thermal slowdown


class ClockWatch:
    """The GPU's SM clock, power draw and throttle reasons while a block runs, sampled by
    ``nvidia-smi`` every ``interval_ms`` in a process beside it: a GPU at its power limit lowers
    its clock, so two timings on one board compare only at their clocks (one engine's kernels
    may hold the board at its limit where another's leave it at full clock). ``summary()`` is
    None where ``nvidia-smi`` is missing or sampled nothing, or with ``enabled`` false (a CPU).

    .. code-block:: python

        with ClockWatch(0) as watch:
            run()
        report["clocks"] = watch.summary()
    """

    def __init__(self, device_index: int = 0, interval_ms: int = 100, enabled: bool = True) -> None:
        import os

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [x.strip() for x in visible.split(",")] if visible else []
        # (nvidia-smi -i takes an index, a UUID or a PCI bus id, as CUDA_VISIBLE_DEVICES may hold)
        self.target = ids[device_index] if device_index < len(ids) else str(device_index)
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, float, int]] = []  # (SM MHz, watts, reasons)
        self.enabled = enabled
        self._proc: Any = None

    def __enter__(self) -> ClockWatch:
        import shutil
        import subprocess

        exe = shutil.which("nvidia-smi") if self.enabled else None
        if exe is None:
            return self
        query = "clocks.sm,power.draw,clocks_throttle_reasons.active"
        cmd = [exe, "-i", self.target, f"--query-gpu={query}", "--format=csv,noheader,nounits"]
        try:
            self._proc = subprocess.Popen(
                [*cmd, "-lms", str(self.interval_ms)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:  # (not runnable here: nothing sampled, the benchmark goes on)
            self._proc = None
        return self

    def __exit__(self, *exc: Any) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=5)
        except Exception:
            proc.kill()
            out, _ = proc.communicate()
        self.samples = [s for s in map(_clock_sample, out.splitlines()) if s is not None]

    def summary(self) -> dict[str, Any] | None:
        """The samples' median and lowest SM clock (MHz), highest power (W), and the share of
        samples throttled for power and for heat; None without samples."""
        import statistics

        if not self.samples:
            return None
        mhz = [s[0] for s in self.samples]
        n = len(self.samples)
        return {
            "samples": n,
            "sm_mhz_median": statistics.median(mhz),
            "sm_mhz_min": min(mhz),
            "power_w_max": max(s[1] for s in self.samples),
            "power_capped_share": round(sum(1 for s in self.samples if s[2] & _POWER_CAP) / n, 3),
            "thermal_share": round(sum(1 for s in self.samples if s[2] & _THERMAL) / n, 3),
        }


def _clock_sample(line: str) -> tuple[float, float, int] | None:
    """One ``nvidia-smi`` line of ``clocks.sm, power.draw, reasons`` (no units), or None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        return float(parts[0]), float(parts[1]), int(parts[2], 16)
    except ValueError:  # ("[N/A]" where the board does not say)
        return None
