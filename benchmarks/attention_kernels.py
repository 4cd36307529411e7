"""Attention kernel benchmark: decode and prefill for Llama-3.1-8B's heads, per backend.

Decode: batch 1, 64, 256 at contexts 1k, 4k, 16k; the figure is KV bytes read per second against
the GPU's measured copy bandwidth. Prefill: one sequence of 1k to 8k tokens; the figure is
attention FLOP/s. The torch reference runs in the same process where its memory allows.

    python benchmarks/attention_kernels.py --backends flashinfer,triton,torch_native
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.bench.device import copy_bandwidth, time_fn
from pagoda.bench.report import commit as report_commit
from pagoda.bench.report import save_report
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="flashinfer,triton,torch_native")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
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
