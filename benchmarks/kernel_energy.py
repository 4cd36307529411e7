"""Time and energy a call of each kernel of an embedding step (Qwen3-0.6B's shapes, 32,768 rows,
bf16), each run alone for a while at the board's steady state::

    python benchmarks/kernel_energy.py --output-json OUT.json
    python benchmarks/kernel_energy.py --ops "mm qkv" "fused qkv+store"

Why energy: an embedding call of 256 prompts of 512 tokens keeps an H200 at its 700 W limit from
its first step on, and the board then lowers its clock to stay there, so a call's wall is its
energy over 700 W. A kernel that is faster alone by drawing more power gains less in the engine;
one that moves fewer bytes or issues fewer instructions gains more than its time alone says.
Each op here runs for ``--seconds`` after ``--settle`` seconds of the same calls, and the
report gives its microseconds and millijoules a call (the driver's energy counter, read through
NVML), its watts, its median SM clock and, for products, its TFLOP/s and picojoules a FLOP.

Needs a CUDA device and NVML (``libnvidia-ml.so.1``); the fused kernels need Hopper.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


class EnergyCounter:
    """The device's energy counter (millijoules since the driver loaded) and its SM clock,
    through NVML."""

    def __init__(self, index: int = 0) -> None:
        try:
            self._lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as e:
            raise SystemExit(f"kernel_energy: NVML (libnvidia-ml.so.1) is not loadable: {e}") from e
        if self._lib.nvmlInit_v2() != 0:
            raise SystemExit("kernel_energy: nvmlInit failed")
        self._handle = ctypes.c_void_p()
        if self._lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self._handle)) != 0:
            raise SystemExit(f"kernel_energy: NVML has no device {index}")

    def millijoules(self) -> int:
        value = ctypes.c_ulonglong()
        self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(value))
        return value.value

    def sm_mhz(self) -> int:
        value = ctypes.c_uint()
        self._lib.nvmlDeviceGetClockInfo(self._handle, 1, ctypes.byref(value))  # 1: SM
        return value.value


def figures(name: str, calls: int, seconds: float, millijoules: float, flops: float,
            clocks: list[int]) -> dict[str, Any]:  # fmt: skip
    """One op's row: per call, and per FLOP where it is a product (``flops`` > 0)."""
    if calls < 1 or seconds <= 0:
        raise ValueError(f"{name}: {calls} calls in {seconds} s")
    per_call_s = seconds / calls
    joules = millijoules / 1e3 / calls
    row = {
        "op": name,
        "us": round(per_call_s * 1e6, 1),
        "mJ": round(joules * 1e3, 1),
        "W": round(millijoules / 1e3 / seconds),
        "sm_mhz": statistics.median(clocks) if clocks else None,
    }
    if flops:
        row["tflops"] = round(flops / per_call_s / 1e12)
        row["pJ_per_flop"] = round(joules / flops * 1e12, 3)
    return row


def step_ops(rows: int) -> dict[str, tuple[Callable[[], Any], float]]:
    """The ops of one layer of a Qwen3-0.6B embedding step of ``rows`` tokens: name -> (call,
    FLOPs of its product, 0 for none)."""
    import torch

    from pagoda import ops
    from pagoda.attention.backend import write_kv_cache
    from pagoda.ops.triton_gated_gemm import gate_up_silu_triton
    from pagoda.ops.triton_qkv_norm_rotary import qkv_norm_rotary_triton

    m, hidden, inter, qh, kvh, d = rows, 1024, 3072, 16, 8, 128
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    torch.manual_seed(0)
    x, res = torch.randn(m, hidden, **bf), torch.randn(m, hidden, **bf)
    w_qkv = torch.randn((qh + 2 * kvh) * d, hidden, **bf) * 0.03
    w_gu = torch.randn(2 * inter, hidden, **bf) * 0.03
    w_o, a_o = torch.randn(hidden, qh * d, **bf) * 0.03, torch.randn(m, qh * d, **bf)
    w_d, a_d = torch.randn(hidden, inter, **bf) * 0.03, torch.randn(m, inter, **bf)
    norm_w, head_w = torch.ones(hidden, **bf), torch.ones(d, **bf)
    pos = torch.arange(m, device="cuda") % 512  # (prompts of 512 tokens)
    angles = torch.arange(40960, device="cuda")[:, None] * (
        1e6 ** (-torch.arange(0, d, 2, device="cuda") / d)
    )
    cos, sin = angles.cos(), angles.sin()
    blocks = -(-m // 16) + 64
    cache = torch.zeros(2, blocks, 16, kvh, d, **bf)
    slots = torch.randperm(blocks * 16, device="cuda")[:m].sort().values

    def qkv_apart() -> None:
        y = x @ w_qkv.T
        q, k, v = y.split([qh * d, kvh * d, kvh * d], dim=1)
        q, k = ops.qk_norm_rotary(
            pos, q.view(m, qh, d), k.view(m, kvh, d), head_w, head_w, 1e-6, cos, sin
        )
        write_kv_cache(k, v.view(m, kvh, d), cache, slots, m)

    def qkv_fused() -> None:
        args = (x, w_qkv, qh, kvh, d, head_w, head_w, 1e-6, pos, cos, sin)
        qkv_norm_rotary_triton(*args, kv_cache=cache, slot_mapping=slots)

    qkv = 2.0 * m * hidden * (qh + 2 * kvh) * d
    return {
        "mm qkv": (lambda: x @ w_qkv.T, qkv),
        "fused qkv+store": (qkv_fused, qkv),
        "apart qkv+store": (qkv_apart, qkv),
        "mm gate_up": (lambda: x @ w_gu.T, 2.0 * m * hidden * 2 * inter),
        "fused gate_up": (lambda: gate_up_silu_triton(x, w_gu), 2.0 * m * hidden * 2 * inter),
        "mm o": (lambda: a_o @ w_o.T, 2.0 * m * qh * d * hidden),
        "addmm o": (lambda: torch.addmm(res, a_o, w_o.T), 2.0 * m * qh * d * hidden),
        "mm down": (lambda: a_d @ w_d.T, 2.0 * m * inter * hidden),
        "addmm down": (lambda: torch.addmm(res, a_d, w_d.T), 2.0 * m * inter * hidden),
        "rms_norm": (lambda: ops.rms_norm(x, norm_w, 1e-6), 0.0),
        "rms_norm+residual": (lambda: ops.rms_norm(x, norm_w, 1e-6, res), 0.0),
    }


def measure(name: str, fn: Callable[[], Any], flops: float, counter: EnergyCounter,
            settle: float, seconds: float) -> dict[str, Any]:  # fmt: skip
    import torch

    for _ in range(20):  # (compiles, then the allocator's blocks)
        fn()
    torch.cuda.synchronize()
    end = time.perf_counter() + settle
    while time.perf_counter() < end:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, clocks = 0, []
    e0 = counter.millijoules()
    start.record()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        clocks.append(counter.sm_mhz())
    stop.record()
    torch.cuda.synchronize()
    # NOTE: the counter lags the work by up to a few tens of milliseconds: read it after a pause
    # (whose idle draw adds about 1% to a 1.5 s window).
    time.sleep(0.15)
    e1 = counter.millijoules()
    return figures(name, calls, start.elapsed_time(stop) / 1e3, e1 - e0, flops, clocks)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32768, help="tokens of the step")
    p.add_argument("--ops", nargs="*", default=None, help="which ops (default: all)")
    p.add_argument("--settle", type=float, default=0.7, help="seconds of calls before timing")
    p.add_argument("--seconds", type=float, default=1.5, help="seconds timed an op")
    p.add_argument("--pause", type=float, default=1.0, help="seconds idle between ops")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("kernel_energy: needs a CUDA device (it reads the board's energy counter)")
    from pagoda.bench.report import commit, hardware, save_report

    counter = EnergyCounter(torch.cuda.current_device())
    available = step_ops(args.rows)
    names = args.ops or list(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise SystemExit(f"kernel_energy: unknown ops {unknown}; known: {list(available)}")
    rows = []
    for name in names:
        fn, flops = available[name]
        rows.append(measure(name, fn, flops, counter, args.settle, args.seconds))
        print(rows[-1], flush=True)
        time.sleep(args.pause)
    report = {
        "benchmark": "kernel_energy",
        "hardware": hardware(torch.device("cuda")),
        "commit": commit(),
        "rows_a_step": args.rows,
        "settle_s": args.settle,
        "seconds": args.seconds,
        "ops": rows,
    }
    path = save_report(report, f"kernel-energy-qwen3-0.6b-{args.rows}", args.output_json)
    print(f"saved {path}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
