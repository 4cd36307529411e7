"""Decode attention over a bf16 and an FP8 KV cache: the Triton backend's kernel against
FlashInfer's decode kernels, on the same pages (Llama-3.1-8B's heads by default).

One batch of decode requests whose contexts are uniform in [ctx/5, 9*ctx/5], over a shuffled
block table, each kernel replayed from a CUDA graph. The figure is KV bytes read per second
against the measured copy bandwidth. An FP8 cache holds ``fp8(x / scale)`` with per-layer
scales on the device (as ``cache.kv_cache_dtype: fp8`` stores it); the FlashInfer rows with
``+ scales`` include the two small kernels its engine path runs around the kernel (the query
times ``k_scale``, the output times ``v_scale``: FlashInfer takes its scales as host floats,
which a captured graph would freeze). Each FlashInfer output is checked against Triton's.

    python benchmarks/decode_attention_fp8.py [--batch 256] [--ctx 640] [--heads 32]
"""

from __future__ import annotations

import argparse
import functools

import torch
from pagoda_attention_triton.kernels import longest_first, paged_attention, transposed_values

from pagoda.bench.device import copy_bandwidth, graph_time, time_fn
from pagoda.bench.report import commit, hardware, save_report

KV_HEADS, HEAD_DIM, PAGE = 8, 128, 16
DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn


def _case(batch: int, ctx: int, device: torch.device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    lens = torch.randint(ctx // 5, 9 * ctx // 5 + 1, (batch,), generator=g)
    blocks = (lens + PAGE - 1) // PAGE
    num_blocks = int(blocks.sum()) + 1
    kv = torch.randn(2, num_blocks, PAGE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).int()
    bt = torch.zeros(batch, int(blocks.max()), dtype=torch.int32)
    indices, off = [], 0
    for i, nb in enumerate(blocks.tolist()):
        bt[i, :nb] = perm[off : off + nb]
        indices.append(perm[off : off + nb])
        off += nb
    indptr = torch.zeros(batch + 1, dtype=torch.int32)
    indptr[1:] = blocks.cumsum(0)
    return {
        "kv": kv,
        "bt": bt.to(device),
        "lens": lens.int().to(device),
        "max_len": int(lens.max()),
        "tokens": int(lens.sum()),
        "indptr": indptr,
        "indices": torch.cat(indices).to(device),
        "last": (lens - (blocks - 1) * PAGE).int(),
    }


def _triton(case: dict, q: torch.Tensor, fp8: bool, scale: torch.Tensor) -> tuple:
    kv = case["kv"]
    batch = q.shape[0]
    scales = {}
    if fp8:
        kv = (kv.float() / scale).to(FP8)
        flipped = kv.clone()  # value pages as `plugins.triton.fp8_transposed_values` stores them
        n = kv.shape[1]
        flipped[1].view(n, KV_HEADS, HEAD_DIM, PAGE).copy_(kv[1].permute(0, 2, 3, 1))
        kv = (flipped[0], transposed_values(flipped))
        scales = {"k_scale": scale, "v_scale": scale}
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    order = torch.from_numpy(longest_first(case["lens"].cpu().numpy())).to(q.device)
    run = functools.partial(
        paged_attention,
        q, kv[0], kv[1], out, case["bt"], case["lens"], qsl, batch, batch, 1, case["max_len"],
        HEAD_DIM**-0.5, 1, order=order, **scales,
    )  # fmt: skip
    return run, out


def _flashinfer(case: dict, q: torch.Tensor, fp8: bool, scale: torch.Tensor, tc: bool):
    import flashinfer

    kv = case["kv"]
    if fp8:
        kv = (kv.float() / scale).to(FP8)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
    w.plan(
        case["indptr"], case["indices"], case["last"], q.shape[1], KV_HEADS, HEAD_DIM, PAGE,
        q_data_type=q.dtype, kv_data_type=kv.dtype, sm_scale=HEAD_DIM**-0.5,
    )  # fmt: skip
    out = torch.empty_like(q)
    qs = torch.empty_like(q)

    def kernel():
        w.run(q, (kv[0], kv[1]), out=out)

    def scaled():  # the engine's path: scales read on the device
        torch.mul(q, scale, out=qs)
        w.run(qs, (kv[0], kv[1]), out=out)
        out.mul_(scale)

    return kernel, scaled, out


def _fa3_fp8(case: dict, q: torch.Tensor, scale: torch.Tensor):
    """FlashInfer's FA3 kernel (Hopper) with the query in FP8 too (its FP8 path needs both), as
    a prefill of one token a request; scales per head, on the device."""
    import flashinfer

    batch, heads = q.shape[0], q.shape[1]
    kv = (case["kv"].float() / scale).to(FP8)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")
    qo = torch.arange(batch + 1, dtype=torch.int32)
    w.plan(
        qo, case["indptr"], case["indices"], case["last"], heads, KV_HEADS, HEAD_DIM, PAGE,
        causal=True, q_data_type=FP8, kv_data_type=FP8, o_data_type=q.dtype,
        sm_scale=HEAD_DIM**-0.5,
    )  # fmt: skip
    q_scale = (q.abs().amax().float() / 448).reshape(1)
    qf = torch.empty(q.shape, dtype=FP8, device=q.device)
    out = torch.empty_like(q)
    sq = q_scale.expand(heads).contiguous()
    sk = scale.expand(KV_HEADS).contiguous()

    def kernel():
        w.run(qf, (kv[0], kv[1]), sq, sk, sk, out=out)

    def scaled():  # the query quantized each step
        torch.div(q, q_scale, out=out)
        qf.copy_(out)
        w.run(qf, (kv[0], kv[1]), sq, sk, sk, out=out)

    return kernel, scaled, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ctx", type=int, default=640)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    bw = copy_bandwidth(device, iters=20)
    case = _case(args.batch, args.ctx, device)
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(args.batch, args.heads, HEAD_DIM, dtype=DTYPE, device=device, generator=g)
    scale = torch.full((1,), 0.5, dtype=torch.float32, device=device)
    rows = []

    def timed(name: str, cache: str, fn, out=None, ref=None) -> None:
        row = {"kernel": name, "cache": cache}
        try:
            t = graph_time(fn, device, calls=10)
        except Exception as e:  # noqa: BLE001 (a variant this FlashInfer build refuses)
            try:
                t = time_fn(fn, 20, device)
                row["timing"] = f"eager ({type(e).__name__} in capture)"
            except Exception as e2:  # noqa: BLE001
                rows.append({**row, "error": f"{type(e2).__name__}: {e2}"[:300]})
                print(rows[-1])
                return
        nbytes = case["tokens"] * KV_HEADS * HEAD_DIM * 2 * (1 if cache == "fp8" else 2)
        row.update(us=round(t * 1e6, 1), of_copy_bw=round(nbytes / t / bw, 3))
        if out is not None and ref is not None:
            fn()
            torch.cuda.synchronize()
            row["max_abs_diff_vs_triton"] = round((out.float() - ref.float()).abs().max().item(), 4)
        rows.append(row)
        print(row, flush=True)

    for fp8 in (False, True):
        cache = "fp8" if fp8 else "bf16"
        run, ref = _triton(case, q, fp8, scale)
        timed("triton", cache, run)
        run()
        torch.cuda.synchronize()
        for tc in (True, False):
            try:
                kernel, scaled, out = _flashinfer(case, q, fp8, scale, tc)
            except Exception as e:  # noqa: BLE001
                rows.append(
                    {"kernel": f"flashinfer tc={tc}", "cache": cache, "error": str(e)[:300]}
                )
                print(rows[-1])
                continue
            name = f"flashinfer decode ({'tensor cores' if tc else 'CUDA cores'})"
            if fp8:
                timed(name, cache, kernel)
                timed(name + " + scales", cache, scaled, out, ref)
            else:
                timed(name, cache, kernel, out, ref)
        if fp8:
            try:
                kernel, scaled, out = _fa3_fp8(case, q, scale)
            except Exception as e:  # noqa: BLE001
                rows.append({"kernel": "flashinfer fa3", "cache": cache, "error": str(e)[:300]})
                print(rows[-1])
            else:
                timed("flashinfer fa3 (FP8 query)", cache, kernel)
                timed("flashinfer fa3 (FP8 query) + quantize", cache, scaled, out, ref)
    report = {
        "benchmark": "decode_attention_fp8",
        "batch": args.batch,
        "ctx": args.ctx,
        "heads": args.heads,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "page": PAGE,
        "gpu": hardware(device),
        "commit": commit(),
        "copy_bandwidth_GBps": round(bw / 1e9, 1),
        "timing": "CUDA graph replay, 10 calls a graph",
        "rows": rows,
    }
    path = save_report(report, f"decode-attention-fp8-h{args.heads}-b{args.batch}-c{args.ctx}",
                       args.output_json)  # fmt: skip
    print(f"batch {args.batch}, contexts ~{args.ctx}; copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'kernel':<44}{'cache':>6}{'us':>9}{'of copy bw':>11}{'diff':>8}")
    for r in rows:
        if "us" in r:
            print(
                f"{r['kernel']:<44}{r['cache']:>6}{r['us']:>9.1f}{r['of_copy_bw']:>11.3f}"
                f"{r.get('max_abs_diff_vs_triton', ''):>8}"
            )
        else:
            print(f"{r['kernel']:<44}{r['cache']:>6}  {r['error'][:60]}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
