"""Attention kernel benchmark: decode and prefill for Llama-3.1-8B's heads, per backend.

Decode: batch 1, 64, 256 at contexts 1k, 4k, 16k; the figure is KV bytes read per second against
the GPU's measured copy bandwidth. Prefill: one sequence of 1k to 8k tokens; the figure is
attention FLOP/s. The torch reference runs in the same process where its memory allows.

    python benchmarks/attention_kernels.py --backends flashinfer,triton,torch_native

``--ragged-prefill``: steps of new prompts only (32 of 512 tokens, an embedding step; 28 of 100 -
1024 tokens) at Qwen3-0.6B's heads, causal, bf16: the Triton backend's paged prefill kernel, its
ragged kernel (``pagoda_attention_triton.ragged_prefill``) at its default launch and a sweep of
launches, torch's flash attention where this torch has one, and the layer's forward (cache write
included) with the ragged kernel on and off. Each output is checked against a float32 reference;
the best launch is printed as the line that makes it the default.

    python benchmarks/attention_kernels.py --ragged-prefill --output-json ragged.json
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import time
from collections.abc import Callable

import numpy as np
import torch

from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.bench.device import copy_bandwidth, time_fn
from pagoda.bench.report import commit as report_commit
from pagoda.bench.report import hardware, save_report
from pagoda.plugins import get_registry

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def _setup(batch: int, ctx: int, q_len: int, device: torch.device):
    blocks_per_seq = -(-ctx // PAGE)
    num_blocks = batch * blocks_per_seq + 1
    kv = torch.randn(2, num_blocks, PAGE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    perm = torch.randperm(num_blocks - 1, device=device) + 1
    block_table = perm.view(batch, blocks_per_seq).int()
    seq_lens = np.full(batch, ctx, dtype=np.int64)
    qsl = np.arange(batch + 1, dtype=np.int64) * q_len
    n = batch * q_len
    pos = np.tile(np.arange(ctx - q_len, ctx), batch)
    rows = np.repeat(np.arange(batch), q_len)
    bt_cpu = block_table.cpu().numpy()
    slots = bt_cpu[rows, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE
    common = CommonAttentionMetadata(
        num_reqs=batch,
        num_actual_tokens=n,
        max_query_len=q_len,
        max_seq_len=ctx,
        query_start_loc=torch.from_numpy(qsl).int().to(device),
        seq_lens=torch.from_numpy(seq_lens).int().to(device),
        block_table=block_table,
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=PAGE,
    )
    q = torch.randn(n, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v = torch.randn_like(k)
    return kv, common, q, k, v


def bench_case(backend_cls, batch: int, ctx: int, q_len: int, device: torch.device) -> float:
    kv, common, q, k, v = _setup(batch, ctx, q_len, device)
    impl = backend_cls.get_impl_cls()(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS)

    def step():
        md = backend_cls.build_metadata(common)
        impl.forward(q, k, v, kv, md)

    return time_fn(step, 10, device)


# --ragged-prefill: Qwen3-0.6B's heads; the launches swept (each with every value of the others),
# then the best few again with two query heads a program.
QWEN_HEADS, QWEN_KV_HEADS = 16, 8
RAGGED_SPACE = {
    "block_m": (64, 128),
    "block_n": (32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
}
STACKED_BEST = 4
MAX_ERR = 0.05  # against the float32 reference: bf16 outputs of unit-normal inputs


def _ragged_workloads() -> dict[str, list[int]]:
    # The second is `triton_decode_tuning.py --prefill 28`'s prompts (same seed, same draw).
    gen = torch.Generator(device="cpu").manual_seed(0)
    return {
        "32x512": [512] * 32,
        "28x100-1024": torch.randint(100, 1025, (28,), generator=gen).tolist(),
    }


class _Ragged:
    """One workload's tensors: queries, the step's keys and values, the paged cache they were
    written to (each prompt's blocks contiguous), and a float32 reference output."""

    def __init__(self, lens: list[int], device: torch.device) -> None:
        # NOTE: the Triton plugin, imported by --ragged-prefill alone.
        from pagoda.ops.triton_kv_write import write_kv_triton

        self.lens, self.n, self.max_len = lens, sum(lens), max(lens)
        gen = torch.Generator(device=device).manual_seed(0)
        h, kv, d = QWEN_HEADS, QWEN_KV_HEADS, HEAD_DIM
        self.q = torch.randn(self.n, h, d, generator=gen, device=device).to(DTYPE)
        self.k = torch.randn(self.n, kv, d, generator=gen, device=device).to(DTYPE)
        self.v = torch.randn(self.n, kv, d, generator=gen, device=device).to(DTYPE)
        qsl = np.concatenate([[0], np.cumsum(lens)])
        blocks = [-(-n // PAGE) for n in lens]
        table = np.zeros((len(lens), max(blocks)), dtype=np.int32)
        starts = np.concatenate([[1], 1 + np.cumsum(blocks)])
        for i, b in enumerate(blocks):
            table[i, :b] = np.arange(starts[i], starts[i] + b)
        rows = np.repeat(np.arange(len(lens)), lens)
        pos = np.concatenate([np.arange(n) for n in lens])
        slots = table[rows, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE
        self.kv_cache = torch.zeros(2, int(starts[-1]), PAGE, kv, d, dtype=DTYPE, device=device)
        self.common = CommonAttentionMetadata(
            num_reqs=len(lens),
            num_actual_tokens=self.n,
            max_query_len=self.max_len,
            max_seq_len=self.max_len,
            query_start_loc=torch.from_numpy(qsl).int().to(device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_table=torch.from_numpy(table).to(device),
            slot_mapping=torch.from_numpy(slots).to(device),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=np.array(lens),
            block_size=PAGE,
        )
        write_kv_triton(self.k, self.v, self.kv_cache, self.common.slot_mapping, self.n)
        self.out = torch.empty_like(self.q)
        self.scale = d**-0.5
        self.flops = 4 * h * d * sum(n * (n + 1) // 2 for n in lens)  # causal: the lower half
        self.want = torch.cat(
            [
                torch.nn.functional.scaled_dot_product_attention(
                    *(t[s:e].float().transpose(0, 1) for t in (self.q, self.k, self.v)),
                    is_causal=True,
                    scale=self.scale,
                    enable_gqa=True,
                ).transpose(0, 1)
                for s, e in zip(qsl[:-1], qsl[1:])
            ]
        )

    def measure(self, fn: Callable[[], torch.Tensor], row: dict) -> dict:
        self.out.fill_(float("nan"))
        try:
            got = fn()
            t = time_fn(fn, 20, self.q.device)
        except Exception as e:  # a launch the compiler refuses (shared memory, say)
            return {**row, "error": f"{type(e).__name__}: {str(e)[:120]}"}
        err = (got[: self.n].float() - self.want).abs().max().item()
        return {
            **row,
            "us": round(t * 1e6, 1),
            "TFLOPs": round(self.flops / t / 1e12, 1),
            "max_abs_err": round(err, 4),
        }


def _torch_flash(w: _Ragged) -> tuple[Callable[[], torch.Tensor], str] | None:
    """torch's flash-attention varlen forward over ``w``, and what it is; None where this torch
    has none. ``aten._flash_attention_forward`` takes the KV heads as they are; an older
    ``varlen_attn`` without ``enable_gqa`` gets them repeated per query head."""
    cu = w.common.query_start_loc
    aten = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if aten is not None:

        def run() -> torch.Tensor:
            args = (w.q, w.k, w.v, cu, cu, w.max_len, w.max_len, 0.0, True, False)
            return aten(*args, scale=w.scale)[0]

        try:
            run()
            return run, "torch.ops.aten._flash_attention_forward"
        except Exception as e:
            print(f"aten._flash_attention_forward: {type(e).__name__}: {str(e)[:120]}")
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kw: dict = {"scale": w.scale} if "scale" in params else {}
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    k, v, name = w.k, w.v, "torch.nn.attention.varlen.varlen_attn"
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:
        g = QWEN_HEADS // QWEN_KV_HEADS
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        name += " (KV heads repeated)"
    return (lambda: varlen_attn(w.q, k, v, cu, cu, w.max_len, w.max_len, **kw)), name


def _ragged_prefill(args: argparse.Namespace, device: torch.device) -> None:
    # NOTE: the Triton plugin, imported by this mode alone (the others run without it).
    from pagoda_attention_triton.backend import TritonAttentionBackend
    from pagoda_attention_triton.kernels import paged_attention
    from pagoda_attention_triton.ragged_prefill import (
        DEFAULT_LAUNCHES,
        RaggedLaunch,
        default_launch,
        ragged_prefill_attention,
    )

    began = time.perf_counter()
    works = {name: _Ragged(lens, device) for name, lens in _ragged_workloads().items()}
    default = default_launch(HEAD_DIM, DTYPE, device, QWEN_HEADS // QWEN_KV_HEADS)
    rows: list[dict] = []

    def ragged(w: _Ragged, launch: RaggedLaunch | None) -> Callable[[], torch.Tensor]:
        c = w.common
        return lambda: ragged_prefill_attention(
            w.q, w.k, w.v, w.out, c.query_start_loc, c.num_reqs, w.n, w.scale, launch=launch
        )

    def launch_row(launch: RaggedLaunch) -> dict:
        return {"kernel": "ragged", **launch.__dict__}

    impl = TritonAttentionBackend.get_impl_cls()(
        QWEN_HEADS, HEAD_DIM, HEAD_DIM**-0.5, QWEN_KV_HEADS
    )
    for name, w in works.items():
        c = w.common

        def paged(w: _Ragged = w, c: CommonAttentionMetadata = c) -> torch.Tensor:
            kc, vc = w.kv_cache[0], w.kv_cache[1]
            a = (w.q, kc, vc, w.out, c.block_table, c.seq_lens, c.query_start_loc, c.num_reqs)
            return paged_attention(*a, w.n, w.max_len, w.max_len, w.scale)

        rows.append(w.measure(paged, {"workload": name, "kernel": "paged (default launch)"}))
        row = {"workload": name, **launch_row(default), "kernel": "ragged (default launch)"}
        rows.append(w.measure(ragged(w, None), row))
        flash = _torch_flash(w)
        if flash is None:
            rows.append({"workload": name, "kernel": "torch flash", "error": "not in this torch"})
        else:
            rows.append(w.measure(flash[0], {"workload": name, "kernel": flash[1]}))
        for on in (False, True):
            TritonAttentionBackend.ragged_prefill = on

            def layer(w: _Ragged = w, c: CommonAttentionMetadata = c) -> torch.Tensor:
                md = TritonAttentionBackend.build_metadata(c)
                return impl.forward(w.q, w.k, w.v, w.kv_cache, md)

            kind = f"layer forward, ragged_prefill={'on' if on else 'off'} (with the cache write)"
            rows.append(w.measure(layer, {"workload": name, "kernel": kind}))
        TritonAttentionBackend.ragged_prefill = True

    def sweep(launches: list[RaggedLaunch]) -> None:
        for launch in launches:
            for name, w in works.items():
                row = {"workload": name, **launch_row(launch)}
                if time.perf_counter() - began > args.budget_s:
                    rows.append({**row, "error": "skipped: past --budget-s"})
                else:
                    rows.append(w.measure(ragged(w, launch), row))

    space = [RaggedLaunch(*p) for p in itertools.product(*RAGGED_SPACE.values())]
    sweep(space)
    # The best launches by their summed time over the workloads, then stacked (2 heads a program).
    best = _best_launches(rows, len(works))
    sweep([RaggedLaunch(*b[:4], heads_per_program=2) for b in best[:STACKED_BEST]])
    best = _best_launches(rows, len(works))
    report = {
        "benchmark": "ragged_prefill",
        "gpu": hardware(device),
        "commit": report_commit(),
        "shape": {"heads": QWEN_HEADS, "kv_heads": QWEN_KV_HEADS, "head_dim": HEAD_DIM},
        "dtype": str(DTYPE).removeprefix("torch."),
        "causal": True,
        "workloads": {name: w.lens for name, w in works.items()},
        "default_launch": default.__dict__,
        "best_launch": RaggedLaunch(*best[0]).__dict__ if best else None,
        "seconds": round(time.perf_counter() - began, 1),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": rows,
    }
    path = save_report(report, f"ragged-prefill-{report['commit']}", args.output_json)
    _print_ragged(rows, works)
    if best:
        key = (HEAD_DIM, False)
        print(
            f"best launch: DEFAULT_LAUNCHES[{key}] = RaggedLaunch{tuple(best[0])} in "
            f"pagoda_attention_triton/ragged_prefill.py (now {DEFAULT_LAUNCHES[key]})"
        )
    print(f"{report['seconds']} s; results: {path}")


def _best_launches(rows: list[dict], workloads: int) -> list[tuple]:
    """Launches measured on every workload and correct, fastest first by their summed time."""
    keys = ("block_m", "block_n", "num_warps", "num_stages", "heads_per_program")
    total: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("kernel") == "ragged" and "us" in r and r["max_abs_err"] < MAX_ERR:
            total.setdefault(tuple(r[k] for k in keys), []).append(r["us"])
    done = [(sum(ts), launch) for launch, ts in total.items() if len(ts) == workloads]
    return [launch for _, launch in sorted(done)]


def _print_ragged(rows: list[dict], works: dict) -> None:
    for name, w in works.items():
        dtype = str(DTYPE).removeprefix("torch.")
        print(f"\n{name}: {len(w.lens)} prompts, {w.n} tokens, causal, {dtype}, Qwen3-0.6B heads")
        print(f"{'kernel':<58}{'launch (m,n,warps,stages,heads)':>33}{'us':>10}{'TFLOP/s':>9}")
        mine = [r for r in rows if r["workload"] == name]
        fixed = [r for r in mine if r["kernel"] != "ragged"]
        keys = ("block_m", "block_n", "num_warps", "num_stages", "heads_per_program")
        swept = sorted(
            (r for r in mine if r["kernel"] == "ragged" and "us" in r),
            key=lambda r: r["us"],
        )
        for r in fixed + swept[:8]:
            launch = ",".join(str(r[k]) for k in keys) if "block_m" in r else ""
            if "error" in r:
                print(f"{r['kernel']:<58}{launch:>33}  {r['error']}")
                continue
            flag = "" if r["max_abs_err"] < MAX_ERR else f"  WRONG (max abs err {r['max_abs_err']})"
            print(f"{r['kernel']:<58}{launch:>33}{r['us']:>10.1f}{r['TFLOPs']:>9.1f}{flag}")
        failed = [r for r in mine if r["kernel"] == "ragged" and "error" in r]
        if failed:
            print(f"({len(failed)} launches not measured: compile errors or past the budget)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="flashinfer,triton,torch_native")
    ap.add_argument("--output-json", default=None)
    ap.add_argument(
        "--ragged-prefill",
        action="store_true",
        help="steps of new prompts at Qwen3-0.6B's heads: the paged and ragged Triton kernels, "
        "a sweep of the ragged one's launches, torch's flash attention",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=65.0,
        help="--ragged-prefill: launches left when this many seconds have passed are skipped",
    )
    args = ap.parse_args()
    device = torch.device("cuda")
    if args.ragged_prefill:
        _ragged_prefill(args, device)
        return
    bw = copy_bandwidth(device)
    registry = get_registry("attention_backends")
    rows = []
    for name in args.backends.split(","):
        backend = registry.get(name)
        for batch in (1, 64, 256):
            for ctx in (1024, 4096, 16384):
                kv_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
                if name == "torch_native" and kv_bytes > (2 << 30):
                    continue  # its gather copies the whole context; skip what would not fit
                t = bench_case(backend, batch, ctx, 1, device)
                rows.append(
                    {
                        "backend": name,
                        "kind": "decode",
                        "batch": batch,
                        "context": ctx,
                        "time_us": round(t * 1e6, 1),
                        "kv_bytes": kv_bytes,
                        "bandwidth_TBps": round(kv_bytes / t / 1e12, 3),
                        "fraction_of_copy": round(kv_bytes / t / bw, 3),
                    }
                )
                torch.cuda.empty_cache()
        for n in (1024, 2048, 4096, 8192):
            t = bench_case(backend, 1, n, n, device)
            flops = 4 * HEADS * HEAD_DIM * n * n / 2  # causal: half the square
            rows.append(
                {
                    "backend": name,
                    "kind": "prefill",
                    "batch": 1,
                    "context": n,
                    "time_us": round(t * 1e6, 1),
                    "TFLOPs": round(flops / t / 1e12, 1),
                }
            )
            torch.cuda.empty_cache()
    commit = report_commit()
    report = {
        "benchmark": "attention_kernels",
        "gpu": torch.cuda.get_device_name(device),
        "copy_bandwidth_TBps": round(bw / 1e12, 3),
        "commit": commit,
        "shape": {
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "page": PAGE,
            "dtype": "bfloat16",
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": rows,
    }
    save_report(report, f"attention-kernels-{commit}", args.output_json)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {report['gpu']}")
    print(
        f"{'backend':<14}{'kind':<9}{'batch':>6}{'ctx':>7}{'us':>10}{'TB/s|TFLOPs':>13}{'frac':>7}"
    )
    for r in rows:
        fig = r.get("bandwidth_TBps", r.get("TFLOPs"))
        print(
            f"{r['backend']:<14}{r['kind']:<9}{r['batch']:>6}{r['context']:>7}"
            f"{r['time_us']:>10}{fig:>13}{r.get('fraction_of_copy', ''):>7}"
        )


if __name__ == "__main__":
    main()
