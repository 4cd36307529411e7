"""Decode-step projections: torch's matrix products (cuBLAS) against the skinny Triton kernel.

For each row count (a decode step's batch) the four projections of every layer of a model
(qkv, o, gate/up, down; distinct weights per layer, so nothing is served from the L2 cache) run
in one CUDA graph, timed from its replays: torch's path (``F.linear`` and the SiLU kernel), the
skinny kernel at its chosen launch, and the skinny kernel with SiLU-and-multiply fused into the
down projection. ``--sweep`` also times launch settings per projection. Each path's result is
compared with a float32 product.

The kernel lives here and not in ``pagoda.ops``: on an H200 at Qwen3-0.6B's shapes it did not
beat cuBLAS at any decode batch but 1 (``results/skinny-linear-qwen3-0.6b-h200-dc019de.json``;
``benchmarks/README.md`` has the figures).

    python benchmarks/skinny_linear.py [--config qwen3-0.6b] [--rows 1,8,16,32,64,128] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagoda.bench.report import commit, hardware, save_report
from pagoda.ops.triton_activation import silu_and_mul_triton

CONFIGS = Path(__file__).parent / "configs"


# NOTE: the row count is not specialised on (Triton would compile a variant for multiples of 16).
@triton.jit(do_not_specialize=["m"])
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + rk
        xm = (rm[:, None] < m) & (kk[None, :] < k)
        if SILU_MUL:
            gate = tl.load(x_rows + kk[None, :], mask=xm, other=0.0).to(tl.float32)
            up = tl.load(x_rows + k + kk[None, :], mask=xm, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(w_ptr.dtype.element_ty).to(tl.float32)
            xt = (act * up).to(w_ptr.dtype.element_ty)
        else:
            xt = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
        wt = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < n) & (kk[None, :] < k), other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < n, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < m) & (rn[None, :] < n))


def skinny_launch(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for ``m`` rows of an ``n`` x ``k``
    weight."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 16 if n <= 2048 else 32
    return block_m, block_n, 256, 4, 4


def skinny_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    launch: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x`` [..., K] (with ``silu_mul``, [..., 2 * K] holding gate then up) times ``weight``
    [N, K] transposed, plus ``bias`` [N]: [..., N] in ``x``'s dtype. ``launch`` overrides
    :func:`skinny_launch` (for tuning)."""
    n, k = weight.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if rows.shape[-1] != (2 * k if silu_mul else k):
        raise ValueError(f"skinny_linear: input of {rows.shape[-1]} features for a weight {n}x{k}")
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        bm, bn, bk, warps, stages = launch or skinny_launch(m, n, k)
        _skinny_linear_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
            rows,
            weight,
            bias if bias is not None else weight,
            y,
            m,
            n,
            k,
            rows.stride(0),
            weight.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            SILU_MUL=silu_mul,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=warps,
            num_stages=stages,
        )
    return y.view(*lead, n)


def _graph_ms(fn, replays: int = 20) -> float:
    """Mean milliseconds of one replay of a CUDA graph of ``fn``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compiles and warms outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3-0.6b", help="folder under benchmarks/configs")
    p.add_argument("--rows", default="1,8,16,32,64,128")
    p.add_argument("--sweep", action="store_true", help="time launch settings per projection")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    cfg = json.loads((CONFIGS / args.config / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dev = torch.device("cuda")
    dt = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(dt)

    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}
    weights = [{name: w(*shape) for name, shape in shapes.items()} for _ in range(layers)]
    rows_out = []
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, h, device=dev, generator=gen).to(dt)
        xo = torch.randn(m, q, device=dev, generator=gen).to(dt)

        def torch_path(x=x, xo=xo) -> None:
            for lw in weights:
                F.linear(x, lw["qkv"])
                F.linear(xo, lw["o"])
                F.linear(silu_and_mul_triton(F.linear(x, lw["gate_up"])), lw["down"])

        def skinny_path(fused: bool, x=x, xo=xo) -> None:
            for lw in weights:
                skinny_linear_triton(x, lw["qkv"])
                skinny_linear_triton(xo, lw["o"])
                gu = skinny_linear_triton(x, lw["gate_up"])
                if fused:
                    skinny_linear_triton(gu, lw["down"], silu_mul=True)
                else:
                    skinny_linear_triton(silu_and_mul_triton(gu), lw["down"])

        # Exactness against a float32 product, on layer 0.
        lw = weights[0]
        gu = F.linear(x, lw["gate_up"])
        act = silu_and_mul_triton(gu)
        ref = act.float() @ lw["down"].float().T
        err = {
            "torch": (F.linear(act, lw["down"]).float() - ref).abs().max().item(),
            "skinny": (skinny_linear_triton(act, lw["down"]).float() - ref).abs().max().item(),
            "skinny_fused": (skinny_linear_triton(gu, lw["down"], silu_mul=True).float() - ref)
            .abs()
            .max()
            .item(),
        }
        row = {
            "rows": m,
            "torch_ms": round(_graph_ms(torch_path), 4),
            "skinny_ms": round(_graph_ms(lambda: skinny_path(False)), 4),
            "skinny_fused_ms": round(_graph_ms(lambda: skinny_path(True)), 4),
            "max_abs_err_down": {k: round(v, 5) for k, v in err.items()},
            "launch": {name: skinny_launch(m, *shape) for name, shape in shapes.items()},
        }
        if args.sweep:
            row["sweep"] = {}
            for name, (n, k) in shapes.items():
                xi = x if k == h else torch.randn(m, k, device=dev, generator=gen).to(dt)
                ws = [lw[name] for lw in weights]
                res = {
                    "torch": round(_graph_ms(lambda xi=xi, ws=ws: [F.linear(xi, a) for a in ws]), 4)
                }
                bm = skinny_launch(m, n, k)[0]
                for bn, bk, warps, stages in itertools.product(
                    (16, 32, 64), (128, 256), (4, 8), (3, 4, 6)
                ):
                    launch = (bm, bn, bk, warps, stages)
                    try:
                        ms = _graph_ms(
                            lambda xi=xi, name=name, launch=launch: [
                                skinny_linear_triton(xi, lw[name], launch=launch) for lw in weights
                            ]
                        )
                    except Exception as e:  # a launch that does not fit (shared memory)
                        res[str(launch)] = type(e).__name__
                        continue
                    res[str(launch)] = round(ms, 4)
                timed = {k2: v for k2, v in res.items() if isinstance(v, float) and k2 != "torch"}
                best = min(timed, key=timed.get)
                row["sweep"][name] = {
                    "torch_ms": res["torch"],
                    "best": best,
                    "best_ms": timed[best],
                    "all": res,
                }
                print(
                    f"  rows {m:4d} {name:8s} torch {res['torch']:.4f} ms  best {best} "
                    f"{timed[best]:.4f} ms  chosen {str(skinny_launch(m, n, k))} "
                    f"{res.get(str(skinny_launch(m, n, k)), '-')}",
                    flush=True,
                )
        rows_out.append(row)
        print(
            f"rows {m:4d}: torch {row['torch_ms']:.4f} ms  skinny {row['skinny_ms']:.4f}  "
            f"skinny+silu {row['skinny_fused_ms']:.4f}  (all {layers} layers)  err {err}",
            flush=True,
        )
    report = {
        "benchmark": "skinny_linear",
        "config": args.config,
        "gpu": torch.cuda.get_device_name(dev),
        "hardware": hardware(dev),
        "commit": commit(),
        "rows": rows_out,
    }
    save_report(report, f"skinny-linear-{args.config}-{commit()}", args.output_json)


if __name__ == "__main__":
    main()
