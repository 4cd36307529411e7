"""Launch settings of the Triton paged-attention kernel for decode, swept at a model's heads
(Llama-3.1-8B's by default; ``--heads 16`` for Qwen3-0.6B's).

Each case is a batch of decode requests whose contexts are uniform in [ctx/5, 9*ctx/5] (a
workload's spread), over a shuffled block table. Settings: keys per loop iteration (tile_n),
warps, pipeline stages, context splits (``--splits``: each request's keys cut in that many
slices merged after, as flash-decoding does, which evens out the programs' lengths), and the page
layout: token-major pages (``[block, token, head, dim]``, the default cache) or head-major pages
(``[block, head, token, dim]``, one head's page contiguous).
The figure is KV bytes read per second against the measured copy bandwidth. ``--fp8``: the
cache in FP8 e4m3 with per-layer scales (one byte a value), as ``kv_cache_dtype: fp8`` stores it;
``--transposed-values``: value pages stored transposed, as ``plugins.triton.fp8_transposed_values``
stores them (token-major pages only).

    python benchmarks/triton_decode_tuning.py [--batch 256] [--ctx 640] [--heads 32] [--fp8]
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
from pagoda_attention_triton.kernels import longest_first, paged_attention, transposed_values

from pagoda.bench.device import copy_bandwidth, graph_time, time_fn
from pagoda.bench.report import commit, hardware, save_report

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def _case(
    batch: int,
    ctx: int,
    head_major: bool,
    device: torch.device,
    equal: bool = False,
    fp8: bool = False,
    transposed: bool = False,
):
    g = torch.Generator(device="cpu").manual_seed(0)
    lens = torch.randint(ctx // 5, 9 * ctx // 5 + 1, (batch,), generator=g)
    if equal:  # every request at the same context, as a batch of equal prompts decodes
        lens = torch.full((batch,), ctx)
    blocks = (lens + PAGE - 1) // PAGE
    max_blocks = int(blocks.max())
    num_blocks = int(blocks.sum()) + 1
    shape = (2, num_blocks, KV_HEADS, PAGE, HEAD_DIM) if head_major else None
    if head_major:
        kv = torch.randn(shape, dtype=DTYPE, device=device).transpose(2, 3)
    else:
        kv = torch.randn(2, num_blocks, PAGE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).int()
    bt = torch.zeros(batch, max_blocks, dtype=torch.int32)
    off = 0
    for i, nb in enumerate(blocks.tolist()):
        bt[i, :nb] = perm[off : off + nb]
        off += nb
    if fp8:  # stored as fp8(x / scale), as the engine's cache write stores them
        kv = (kv.float() / 0.5).to(torch.float8_e4m3fn)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * kv.dtype.itemsize
    if transposed:  # the same values, each page stored [head, dim, token] (`transposed_values`)
        flipped = kv.clone()
        flipped[1].view(num_blocks, KV_HEADS, HEAD_DIM, PAGE).copy_(kv[1].permute(0, 2, 3, 1))
        kv = (flipped[0], transposed_values(flipped))
    return kv, bt.to(device), lens.int().to(device), qsl, q, kv_bytes, int(lens.max())


def _sweep(
    case: tuple,
    batch: int,
    head_major: bool,
    bw: float,
    splits: tuple[int, ...],
    space: tuple,
    graphs: bool,
    schedules: tuple[int, ...] = (0,),
) -> list[dict]:
    kv, bt, lens, qsl, q, kv_bytes, max_len = case
    out = torch.empty_like(q)
    order = torch.from_numpy(longest_first(lens.cpu().numpy())).to(q.device)
    scales = {}
    if kv[0].dtype == torch.float8_e4m3fn:
        half = torch.full((1,), 0.5, dtype=torch.float32, device=q.device)
        scales = {"k_scale": half, "v_scale": half}
    rows = []
    for tile_n, warps, stages, ns, hpp in itertools.product(*space, splits, schedules):
        setting = {"head_major": head_major, "tile_n": tile_n, "num_warps": warps}
        setting["num_stages"] = stages
        setting["num_splits"] = ns
        # 0: requests in batch order, a program a head; k: longest first, k heads a program
        setting["heads_per_program"] = hpp
        extra = {"order": order, "heads_per_program": hpp} if hpp else {}
        run = functools.partial(
            paged_attention,
            q, kv[0], kv[1], out, bt, lens, qsl, batch, batch, 1, max_len, HEAD_DIM**-0.5, ns,
            tile_n=tile_n, num_warps=warps, num_stages=stages, **extra, **scales,
        )  # fmt: skip
        try:
            t = graph_time(run, q.device, calls=10) if graphs else time_fn(run, 20, q.device)
        except Exception as e:  # a setting the compiler refuses (shared memory, say)
            rows.append({**setting, "error": type(e).__name__})
            continue
        rows.append({**setting, "us": round(t * 1e6, 1), "of_copy_bw": round(kv_bytes / t / bw, 3)})
    return rows


def _prefill(args, device: torch.device) -> None:
    """Prefill: ``--prefill N`` prompts of 100 - 1024 tokens, every token a query, causal."""
    g = torch.Generator(device="cpu").manual_seed(0)
    lens = torch.randint(100, 1025, (args.prefill,), generator=g)
    blocks = (lens + PAGE - 1) // PAGE
    num_blocks = int(blocks.sum()) + 1
    kv = torch.randn(2, num_blocks, PAGE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    bt = torch.zeros(args.prefill, int(blocks.max()), dtype=torch.int32)
    off = 1
    for i, nb in enumerate(blocks.tolist()):
        bt[i, :nb] = torch.arange(off, off + nb)
        off += nb
    bt = bt.to(device)
    n = int(lens.sum())
    q = torch.randn(n, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    qsl = torch.zeros(args.prefill + 1, dtype=torch.int32)
    qsl[1:] = lens.cumsum(0)
    qsl, seq = qsl.to(device), lens.int().to(device)
    flops = 4 * HEADS * HEAD_DIM * sum(x * (x + 1) // 2 for x in lens.tolist())
    out = torch.empty_like(q)
    rows = []
    space = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
    for block_m, tile_n, warps, stages in space:
        setting = {"block_m": block_m, "tile_n": tile_n, "num_warps": warps, "num_stages": stages}
        run = functools.partial(
            paged_attention,
            q, kv[0], kv[1], out, bt, seq, qsl, args.prefill, n, int(lens.max()), int(lens.max()),
            HEAD_DIM**-0.5, 1, tile_n=tile_n, num_warps=warps, num_stages=stages, block_m=block_m,
        )  # fmt: skip
        try:
            t = time_fn(run, 10, device)
        except Exception as e:  # a setting the compiler refuses (shared memory, say)
            rows.append({**setting, "error": type(e).__name__})
            continue
        rows.append({**setting, "us": round(t * 1e6, 1), "tflops": round(flops / t / 1e12, 1)})
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    report = {
        "benchmark": "triton_prefill_tuning",
        "prompts": args.prefill,
        "tokens": n,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "gpu": hardware(device),
        "commit": commit(),
        "rows": rows,
    }
    path = save_report(report, f"triton-prefill-tuning-h{HEADS}-p{args.prefill}", args.output_json)
    default = [
        r for r in rows if "us" in r and (r["block_m"], r["tile_n"], r["num_warps"]) == (64, 64, 4)
    ]
    print(f"prefill of {args.prefill} prompts, {n} tokens")
    print(f"{'block_m':>8}{'tile_n':>7}{'warps':>6}{'stages':>7}{'us':>10}{'TFLOP/s':>9}")
    for r in default + ok[:10]:
        print(
            f"{r['block_m']:>8}{r['tile_n']:>7}{r['num_warps']:>6}{r['num_stages']:>7}"
            f"{r['us']:>10.1f}{r['tflops']:>9.1f}"
        )
    print(f"results: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ctx", type=int, default=640)
    p.add_argument("--heads", type=int, default=32, help="query heads (Qwen3-0.6B: 16)")
    p.add_argument("--splits", default="1", help="context splits to try, comma-separated")
    p.add_argument("--quick", action="store_true", help="a smaller sweep (tiles 64/128, ...)")
    p.add_argument(
        "--launch", default=None, help="one setting only, tile_n,warps,stages (the default 128,4,2)"
    )
    p.add_argument("--equal", action="store_true", help="every context exactly --ctx")
    p.add_argument("--token-major-only", action="store_true", help="leave out head-major pages")
    p.add_argument(
        "--graphs", action="store_true", help="time replays of CUDA graphs (as decode runs)"
    )
    p.add_argument(
        "--prefill", type=int, default=0, help="tune prefill instead, over this many prompts"
    )
    p.add_argument(
        "--heads-per-program",
        default="0",
        help="decode schedules, comma-separated: 0 requests in batch order, a program a KV head; "
        "k requests longest first, k KV heads a program (unsplit) or one (split)",
    )
    p.add_argument("--fp8", action="store_true", help="an FP8 e4m3 cache (kv_cache_dtype: fp8)")
    p.add_argument(
        "--transposed-values",
        action="store_true",
        help="value pages stored transposed (plugins.triton.fp8_transposed_values)",
    )
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    global HEADS
    HEADS = args.heads
    if args.prefill:
        _prefill(args, torch.device("cuda"))
        return
    splits = tuple(int(x) for x in args.splits.split(","))
    device = torch.device("cuda")
    bw = copy_bandwidth(device, iters=20)
    rows = []
    space = ((64, 128), (4, 8), (2, 3)) if args.quick else ((32, 64, 128), (2, 4, 8), (2, 3, 4))
    if args.launch:
        space = tuple((int(x),) for x in args.launch.split(","))
    for head_major in (
        (False,) if args.token_major_only or args.transposed_values else (False, True)
    ):
        case = _case(
            args.batch, args.ctx, head_major, device, args.equal, args.fp8, args.transposed_values
        )
        schedules = tuple(int(x) for x in args.heads_per_program.split(","))
        rows += _sweep(case, args.batch, head_major, bw, splits, space, args.graphs, schedules)
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    report = {
        "benchmark": "triton_decode_tuning",
        "batch": args.batch,
        "ctx": args.ctx,
        "equal_contexts": args.equal,
        "kv_cache_dtype": "fp8" if args.fp8 else "bfloat16",
        "transposed_values": args.transposed_values,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "gpu": hardware(device),
        "commit": commit(),
        "copy_bandwidth_GBps": round(bw / 1e9, 1),
        "timing": "CUDA graph replay" if args.graphs else "eager calls",
        "rows": rows,
    }
    name = f"triton-decode-tuning-h{HEADS}-b{args.batch}-c{args.ctx}" + ("-fp8" if args.fp8 else "")
    name += "-tv" if args.transposed_values else ""
    path = save_report(report, name, args.output_json)
    default = [
        r
        for r in rows
        if "us" in r
        and not r["head_major"]
        and r["tile_n"] == 128
        and r["num_warps"] == 4
        and r["num_stages"] == 2
        and r["num_splits"] == 1
    ]
    cache = "fp8" if args.fp8 else "bf16"
    print(
        f"batch {args.batch}, contexts ~{args.ctx}, {cache} cache; "
        f"copy bandwidth {bw / 1e9:.0f} GB/s"
    )
    print(
        f"{'layout':<12}{'tile_n':>7}{'warps':>6}{'stages':>7}{'splits':>7}{'heads/prog':>11}"
        f"{'us':>9}{'of copy bw':>11}"
    )
    for r in default + ok[:12]:
        lay = "head-major" if r["head_major"] else "token-major"
        print(
            f"{lay:<12}{r['tile_n']:>7}{r['num_warps']:>6}{r['num_stages']:>7}"
            f"{r['num_splits']:>7}{r['heads_per_program']:>11}{r['us']:>9.1f}"
            f"{r['of_copy_bw']:>11.3f}"
        )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
