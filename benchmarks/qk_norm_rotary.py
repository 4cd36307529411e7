"""Fused q/k norm and rotary benchmark: each variant of ``qk_norm_rotary_triton`` (where a head's
halves come from, tokens a program takes, warps) against the separate kernels it replaces (the norm
kernel on q, on k, then the rotary kernel), at 16,384 and 32,768 tokens of Qwen3-0.6B's heads in
bf16, q and k strided views of one qkv projection.

Each figure is the median over repeats of the mean time of a run of calls, measured with CUDA events
after warm-up; GB/s counts one read of q and k and one write of each (what the fused kernel must
move at least). Every variant is checked to give the separate kernels' bits.

    python benchmarks/qk_norm_rotary.py [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

import torch

from pagoda.bench.report import commit as report_commit
from pagoda.bench.report import hardware, save_report
from pagoda.loader import ModelArchConfig

CONFIGS = Path(__file__).parent / "configs"
MODEL = "qwen3-0.6b"
TOKENS = (16384, 32768)
DTYPE = torch.bfloat16
INNER, REPEATS = 50, 5
# Keywords of qk_norm_rotary_triton (num_warps None: the norm kernel's, 8); its default is the
# last (swap, 2 tokens a program, 4 warps); the first is the kernel it replaced.
VARIANTS = [
    {"halves": h, "tokens_per_program": t, "num_warps": None}
    for h in ("reload", "swap", "split")
    for t in (1, 2, 4)
] + [{"halves": h, "tokens_per_program": 2, "num_warps": 4} for h in ("reload", "swap")]


def _time(fn: Callable[[], object]) -> float:
    """Median seconds per call of ``fn``."""
    for _ in range(5):  # warm-up: compile, allocate
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(INNER):
            fn()  # results are dropped, so their memory is reused
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000 / INNER)
    return statistics.median(times)


def _name(variant: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in variant.items())


def bench(n: int) -> list[dict]:
    from pagoda.models.layers import RotaryEmbedding
    from pagoda.ops.triton_norm import rms_norm_triton
    from pagoda.ops.triton_qk_norm_rotary import qk_norm_rotary_triton
    from pagoda.ops.triton_rotary import rotary_embedding_triton

    a = ModelArchConfig.from_hf_config(json.loads((CONFIGS / MODEL / "config.json").read_text()))
    hd, eps = a.head_dim, a.rms_norm_eps
    q_size, kv_size = a.num_attention_heads * hd, a.num_key_value_heads * hd
    qkv = torch.randn(n, q_size + 2 * kv_size, device="cuda", dtype=DTYPE)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], -1)
    q, k = q.view(n, -1, hd), k.view(n, -1, hd)
    wq = (1 + 0.3 * torch.randn(hd, device="cuda")).to(DTYPE)
    wk = (1 + 0.3 * torch.randn(hd, device="cuda")).to(DTYPE)
    rope = RotaryEmbedding(hd, a.max_position_embeddings, a.rope_theta, a.rope_scaling).cuda()
    pos = torch.randint(0, a.max_position_embeddings, (n,), device="cuda")
    moved = 2 * (q.numel() + k.numel()) * q.element_size()  # read q, k; write q, k

    def separate() -> tuple[torch.Tensor, torch.Tensor]:
        qn, kn = rms_norm_triton(q, wq, eps), rms_norm_triton(k, wk, eps)
        return rotary_embedding_triton(pos, qn, kn, rope.cos, rope.sin)

    want = separate()
    cases: list[tuple[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]] = [
        ("separate kernels", separate)
    ]
    for v in VARIANTS:
        cases.append(
            (
                _name(v),
                lambda v=v: qk_norm_rotary_triton(pos, q, k, wq, wk, eps, rope.cos, rope.sin, **v),
            )
        )
    rows = []
    for name, fn in cases:
        got = fn()
        same = all(torch.equal(g, w) for g, w in zip(got, want))
        t = _time(fn)
        rows.append(
            {
                "variant": name,
                "tokens": n,
                "us": round(t * 1e6, 2),
                "gb_s": round(moved / t / 1e9, 1),
                "same_bits": same,
            }
        )
    base = rows[0]["us"]
    for r in rows:
        r["speedup"] = round(base / r["us"], 2)
    del qkv, want
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/qk_norm_rotary.py times CUDA kernels: no CUDA device found")
    if find_spec("triton") is None:
        raise SystemExit(
            "benchmarks/qk_norm_rotary.py times Triton kernels: triton is not installed"
        )
    rows = [r for n in TOKENS for r in bench(n)]
    commit = report_commit()
    gpu = hardware(torch.device("cuda"))
    print(
        f"{gpu}, commit {commit}; {MODEL} heads, bf16; us per call (separate = norm, norm, rotary)"
    )
    print(f"{'variant':<48}{'tokens':>7}{'us':>9}{'GB/s':>8}{'speedup':>9}{'bits':>6}")
    for r in rows:
        print(
            f"{r['variant']:<48}{r['tokens']:>7}{r['us']:>9}{r['gb_s']:>8}{r['speedup']:>9}"
            f"{'same' if r['same_bits'] else 'DIFF':>6}"
        )
    if args.output_json:
        report = {
            "benchmark": "qk_norm_rotary",
            "gpu": gpu,
            "commit": commit,
            "model": MODEL,
            "dtype": "bfloat16",
            "method": f"CUDA events, median of {REPEATS} runs of {INNER} calls after warm-up; "
            "GB/s: one read and one write of q and k",
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "results": rows,
        }
        print(f"wrote {save_report(report, 'qk-norm-rotary', args.output_json)}")


if __name__ == "__main__":
    main()
