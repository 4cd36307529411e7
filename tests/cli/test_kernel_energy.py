"""``benchmarks/kernel_energy.py`` on a CPU: a row's per-call and per-FLOP figures from one op's
counts, and a clear stop without a CUDA device (the script reads the board's energy counter)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "kernel_energy", ROOT / "benchmarks" / "kernel_energy.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_row_divides_by_calls_and_by_flops() -> None:
    # 2,000 calls in 1.2 s drawing 840 J: 600 us and 420 mJ a call at 700 W; a product of
    # 2.75e11 FLOPs a call then runs at 458 TFLOP/s and 1.527 pJ a FLOP.
    row = _script().figures("fused qkv", 2000, 1.2, 840_000.0, 2.75e11, [1500, 1545, 1590])
    assert row == {
        "op": "fused qkv",
        "us": 600.0,
        "mJ": 420.0,
        "W": 700,
        "sm_mhz": 1545,
        "tflops": 458,
        "pJ_per_flop": 1.527,
    }
    norm = _script().figures("rms_norm", 10, 0.001, 50.0, 0.0, [])
    assert "tflops" not in norm and norm["sm_mhz"] is None and norm["us"] == 100.0
    with pytest.raises(ValueError, match="0 calls"):
        _script().figures("mm", 0, 1.0, 1.0, 1.0, [])


def test_it_stops_without_a_cuda_device() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        _script().main(["--ops", "mm qkv"])
