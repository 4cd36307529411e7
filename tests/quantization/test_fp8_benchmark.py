"""benchmarks/fp8.py on a CPU, as far as it runs without a GPU: the kernels part's setup on
Llama-3.1-8B's config (which has no ``head_dim``: the H200 run stopped there with a KeyError),
shrunk, each step run once (the linears through the CPU emulation, the attention under the
Triton interpreter); and ``--speed`` keeping the engines' figures in its JSON when the kernels
part fails after them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first compiled

BENCH = Path(__file__).parents[2] / "benchmarks" / "fp8.py"


@pytest.fixture(scope="module")
def fp8_bench():
    spec = importlib.util.spec_from_file_location("fp8_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def small_cfg(fp8_bench) -> dict:
    """Llama-3.1-8B's config with smaller sizes (and, like it, no head_dim)."""
    cfg = json.loads((fp8_bench.LLAMA_8B / "config.json").read_text())
    assert "head_dim" not in cfg
    return {**cfg, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # fmt: skip


def test_head_dim_of_a_config_without_one(fp8_bench) -> None:
    cfg = json.loads((fp8_bench.LLAMA_8B / "config.json").read_text())
    assert fp8_bench.head_dim(cfg) == 128
    assert fp8_bench.head_dim({**cfg, "head_dim": 64}) == 64


def test_the_linears_steps_run(fp8_bench, small_cfg) -> None:
    steps = fp8_bench.linear_steps(small_cfg, 4, torch.device("cpu"), layers=2)
    shapes = {s["kernel"]: s["shape"] for s in steps}
    assert shapes == {"qkv_proj": [4, 128, 256], "o_proj": [4, 128, 128],
                      "gate_up_proj": [4, 128, 512], "down_proj": [4, 256, 128]}  # fmt: skip
    for s in steps:
        s["step"]()


@pytest.mark.skipif(
    importlib.util.find_spec("pagoda_attention_triton") is None, reason="needs the Triton plugin"
)
def test_the_attention_step_runs(fp8_bench, small_cfg, monkeypatch) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setenv("PAGODA_TRITON_ON_CPU", "1")
    att = fp8_bench.attention_step(small_cfg, 2, 40, torch.device(device))
    out = att["step"]()
    assert out.shape == (2, 4, 32) and torch.isfinite(out.float()).all()
    assert att["context"] == 40 and att["moved"] > 0


def _speed_report(fp8_bench, tmp_path, monkeypatch, run) -> dict:
    """The JSON ``fp8.py --speed`` writes with ``run`` standing in for ``subprocess.run`` (a
    part fails in every caller: the exit status is 1)."""
    monkeypatch.setattr(fp8_bench.subprocess, "run", run)
    monkeypatch.setattr(fp8_bench, "config_folder", lambda cfg, tmp: tmp)
    monkeypatch.setattr(fp8_bench, "commit", lambda: "0000000")
    out = tmp_path / "fp8.json"
    monkeypatch.setattr(sys, "argv", ["fp8.py", "--speed", "--output-json", str(out)])
    assert fp8_bench.main() == 1
    return json.loads(out.read_text())


def test_speed_keeps_the_engines_figures_when_the_kernels_part_fails(
    fp8_bench, tmp_path, monkeypatch
) -> None:
    def run(cmd, check=False):
        if "--one-speed" in cmd:
            case = cmd[cmd.index("--one-speed") + 1]
            tps = {"bf16": 100.0, "fp8": 121.0}[case]
            Path(cmd[cmd.index("--result") + 1]).write_text(
                json.dumps({"case": case, "workload_c": {"output_tokens_per_s": tps}})
            )
            return SimpleNamespace(returncode=0)
        assert "--one-kernels" in cmd
        return SimpleNamespace(returncode=1)  # the H200 run's KeyError

    speed = _speed_report(fp8_bench, tmp_path, monkeypatch, run)["speed"]
    assert speed["bf16"]["workload_c"]["output_tokens_per_s"] == 100.0
    assert speed["fp8_over_bf16"] == 1.21
    assert "status 1" in speed["kernels_b256"]["error"]


def test_a_failing_engine_leaves_its_error_in_the_json(fp8_bench, tmp_path, monkeypatch) -> None:
    def run(cmd, check=False):
        raise subprocess.CalledProcessError(1, cmd)

    report = _speed_report(fp8_bench, tmp_path, monkeypatch, run)
    assert report["speed"]["error"].startswith("CalledProcessError")
    assert report["speed"]["model"].startswith("llama-3.1-8b")
