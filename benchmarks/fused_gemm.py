"""The Hopper GEMMs with fused epilogues against the unfused paths they replace, at a model's
shapes (Qwen3-0.6B's by default) and a prefill step's rows (32,768 by default):

- gate/up: ``ops.gate_up_silu`` (``pagoda.ops.triton_gated_gemm``) against cuBLAS's projection,
  alone and followed by ``ops.silu_and_mul``;
- qkv: ``pagoda.ops.triton_qkv_norm_rotary`` (projection, q/k per-head RMSNorm, rotation)
  against cuBLAS's projection, alone and followed by ``ops.qk_norm_rotary``.

Each figure is microseconds a call from ``triton.testing.do_bench`` (L2 flushed between calls).
``--sweep``: every launch of a small grid for each kernel, and the largest difference from the
kernel at its default launch (launches change the accumulation order, not the arithmetic).

    python benchmarks/fused_gemm.py [--model qwen3-0.6b] [--tokens 32768] [--sweep] \\
        [--output-json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

import pagoda.ops as ops
from pagoda.bench.report import commit, hardware, save_report
from pagoda.loader import ModelArchConfig
from pagoda.models.layers import RotaryEmbedding

CONFIGS = Path(__file__).parent / "configs"
DTYPE = torch.bfloat16
# (block_m, block_n, block_k, group_m, stages, warps)
GATE_UP_SWEEP = [
    launch
    for launch in itertools.product((128, 256), (64, 128), (64,), (8,), (2, 3, 4), (8,))
    if launch[0] * launch[1] <= 128 * 128
]
# (block_m, block_k, group_m, stages, warps)
QKV_SWEEP = list(itertools.product((64, 128), (64,), (8,), (3, 4), (4, 8)))


def _us(fn) -> float:
    import triton

    return round(triton.testing.do_bench(fn, warmup=25, rep=200) * 1e3, 1)


def _sweep(run, launches: list[tuple], want: torch.Tensor) -> list[dict]:
    rows = []
    for launch in launches:
        try:
            out = run(launch)
            torch.cuda.synchronize()
        except Exception as e:  # a launch the device cannot hold (shared memory, registers)
            rows.append({"launch": launch, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        diff = (out.float() - want.float()).abs().max().item()
        rows.append({"launch": launch, "us": _us(lambda at=launch: run(at)), "max_diff": diff})
    return sorted(rows, key=lambda r: r.get("us", float("inf")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="a folder of benchmarks/configs")
    p.add_argument("--tokens", type=int, default=32768, help="rows of the step")
    p.add_argument("--sweep", action="store_true", help="time a grid of launches too")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("fused_gemm.py: the kernels need a Hopper GPU (compute capability 9.x)")
    from pagoda.ops import triton_gated_gemm, triton_qkv_norm_rotary

    cfg = json.loads((CONFIGS / args.model / "config.json").read_text())
    a = ModelArchConfig.from_hf_config(cfg)
    m, hidden, inter = args.tokens, a.hidden_size, a.intermediate_size
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, hidden, generator=g, device="cuda").to(DTYPE)
    report: dict = {
        "benchmark": "fused_gemm",
        "model": args.model,
        "tokens": m,
        "hardware": hardware(torch.device("cuda")),
        "commit": commit(),
        "timing": "triton.testing.do_bench, L2 flushed between calls; microseconds a call",
    }

    w = (torch.randn(2 * inter, hidden, generator=g, device="cuda") * hidden**-0.5).to(DTYPE)
    fused = triton_gated_gemm.gate_up_silu_triton(x, w)
    report["gate_up"] = {
        "launch": triton_gated_gemm.LAUNCH,
        "cublas": _us(lambda: ops.linear(x, w)),
        "cublas_then_silu_and_mul": _us(lambda: ops.silu_and_mul(ops.linear(x, w))),
        "fused": _us(lambda: triton_gated_gemm.gate_up_silu_triton(x, w)),
    }
    if args.sweep:
        report["gate_up"]["sweep"] = _sweep(
            lambda launch: triton_gated_gemm.gate_up_silu_triton(x, w, launch),
            [launch for launch in GATE_UP_SWEEP if inter % launch[1] == 0],
            fused,
        )

    qh, kvh, d, eps = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
    if a.qk_norm:
        heads = qh + 2 * kvh
        wqkv = (torch.randn(heads * d, hidden, generator=g, device="cuda") * hidden**-0.5).to(DTYPE)
        wq = (1 + 0.3 * torch.randn(d, generator=g, device="cuda")).to(DTYPE)
        wk = (0.5 + 0.3 * torch.randn(d, generator=g, device="cuda")).to(DTYPE)
        rot = RotaryEmbedding(d, a.max_position_embeddings, a.rope_theta).cuda()
        pos = torch.arange(m, device="cuda") % 512

        def unfused() -> tuple[torch.Tensor, torch.Tensor]:
            q, k, _ = ops.linear(x, wqkv).split([qh * d, kvh * d, kvh * d], -1)
            return ops.qk_norm_rotary(
                pos, q.view(m, qh, d), k.view(m, kvh, d), wq, wk, eps, rot.cos, rot.sin
            )

        def run(launch=None) -> torch.Tensor:
            return triton_qkv_norm_rotary.qkv_norm_rotary_triton(
                x, wqkv, qh, kvh, d, wq, wk, eps, pos, rot.cos, rot.sin, launch
            )

        report["qkv"] = {
            "launch": triton_qkv_norm_rotary.LAUNCH,
            "heads_per_tile": triton_qkv_norm_rotary.heads_per_tile(qh, kvh, d),
            "cublas": _us(lambda: ops.linear(x, wqkv)),
            "cublas_then_qk_norm_rotary": _us(unfused),
            "fused": _us(run),
        }
        if args.sweep:
            report["qkv"]["sweep"] = _sweep(run, QKV_SWEEP, run())
    path = save_report(report, f"fused-gemm-{args.model}-{m}-{report['commit']}", args.output_json)
    for name in ("gate_up", "qkv"):
        if name in report:
            r = report[name]
            print(name, {k: v for k, v in r.items() if k != "sweep"})
            for row in r.get("sweep", [])[:5]:
                print("   ", row)
    print("wrote", path)


if __name__ == "__main__":
    main()
