"""``pagoda.bench.device.ClockWatch``: the clocks, power and throttle reasons that ``nvidia-smi``
samples while a block runs, summarised (a stand-in ``nvidia-smi`` prints the samples here)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from pagoda.bench.device import ClockWatch

# clocks.sm (MHz), power.draw (W), clocks_throttle_reasons.active: full clock, then capped at
# the power limit (0x4), a thermal slowdown (0x20) and a line the board leaves unset.
LINES = [
    "1980, 240.5, 0x0000000000000000",
    "1590, 699.8, 0x0000000000000004",
    "1440, 705.2, 0x0000000000000004",
    "1605, 690.1, 0x0000000000000024",
    "[N/A], [N/A], [N/A]",
]


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``nvidia-smi`` on PATH that records its arguments, prints ``LINES`` and waits to be
    stopped, as ``-lms`` does."""
    exe = tmp_path / "nvidia-smi"
    out = "\n".join(f"echo '{line}'" for line in LINES)
    exe.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/args"\n{out}\nexec sleep 30\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_the_samples_of_the_block_are_summarised(fake_smi: Path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with ClockWatch(1, interval_ms=50) as watch:
        time.sleep(0.5)  # (the stand-in prints at once, then waits like -lms)
    assert watch.summary() == {
        "samples": 4,
        "sm_mhz_median": 1597.5,
        "sm_mhz_min": 1440.0,
        "power_w_max": 705.2,
        "power_capped_share": 0.75,
        "thermal_share": 0.25,
    }
    args = (fake_smi / "args").read_text().split()
    # The board CUDA's device 1 is (the second of CUDA_VISIBLE_DEVICES), every 50 ms.
    assert args[:2] == ["-i", "5"] and args[-2:] == ["-lms", "50"]


def test_nothing_is_sampled_on_a_cpu_or_without_nvidia_smi(fake_smi: Path, monkeypatch) -> None:
    with ClockWatch(0, enabled=False) as watch:
        pass
    assert watch.summary() is None and not (fake_smi / "args").exists()
    monkeypatch.setenv("PATH", str(fake_smi / "empty"))
    with ClockWatch(0) as watch:
        pass
    assert watch.summary() is None
