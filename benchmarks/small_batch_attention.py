"""The Triton paged-attention kernel at small batches and a small model's heads, for decode
(one query a request) and verification (``1 + k`` queries a request) steps: context splits, keys
per tile and pipeline stages.

A decode or verification graph is captured at the engine's ``max_model_len``, and the splits
the backend chooses follow that length, not the contexts the graph later replays with (the
kernel's programs past a context's end return at once). This replays each setting from a CUDA
graph of ``--layers`` calls (one per layer, back to back, as a step runs them) at that captured
length and reports microseconds a call, merge of the splits included.

    python benchmarks/small_batch_attention.py [--heads 9 --kv-heads 3 --head-dim 64]
        [--max-model-len 2048] [--batches 1,4] [--contexts 400,1200,1900] [--queries 1,9]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
from pagoda_attention_triton.backend import TritonAttentionBackend, _layer_splits
from pagoda_attention_triton.kernels import paged_attention

from pagoda.attention.spec import AttentionSpec
from pagoda.bench.device import graph_time
from pagoda.bench.report import commit, hardware, save_report

PAGE = 16


def _case(batch: int, ctx: int, q_len: int, args: argparse.Namespace, device: torch.device):
    """``batch`` requests of context ``ctx`` (their queries included), ``q_len`` queries each,
    their pages shuffled over a cache of ``max_model_len`` tokens a request."""
    g = torch.Generator(device="cpu").manual_seed(0)
    max_blocks = args.max_model_len // PAGE
    num_blocks = batch * max_blocks + 1
    kv = torch.randn(
        2, num_blocks, PAGE, args.kv_heads, args.head_dim, dtype=torch.bfloat16, device=device
    )
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).int()
    table = perm.view(batch, max_blocks).to(device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = (torch.arange(batch + 1, dtype=torch.int32) * q_len).to(device)
    query = torch.randn(
        batch * q_len, args.heads, args.head_dim, dtype=torch.bfloat16, device=device
    )
    return kv, table, lens, qsl, query


def _engine_splits(batch: int, q_len: int, max_model_len: int, device: torch.device) -> int:
    """The splits the backend gives a graph of this step captured at ``max_model_len``."""
    from types import SimpleNamespace

    import numpy as np

    common = SimpleNamespace(
        max_query_len=q_len,
        num_reqs=batch,
        max_seq_len=max_model_len,
        block_table=torch.empty(1, device=device),
        seq_lens_cpu=np.full(batch, max_model_len),
    )
    spec = AttentionSpec(num_heads=1, num_kv_heads=1, head_size=1, scale=1.0)
    planned = TritonAttentionBackend.build_graph_metadata(common).num_splits
    return _layer_splits(planned, max_model_len, spec, q_len)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--batches", default="1,4")
    p.add_argument("--contexts", default="400,1200,1900")
    p.add_argument("--queries", default="1,9")
    p.add_argument("--splits", default="4,8,16,32")
    p.add_argument("--tiles", default="64,128")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--engine-only", action="store_true", help="only the engine's own setting")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    rows = []
    for batch, ctx, q_len in itertools.product(
        ints(args.batches), ints(args.contexts), ints(args.queries)
    ):
        kv, table, lens, qsl, query = _case(batch, ctx, q_len, args, device)
        out = torch.empty_like(query)
        default = _engine_splits(batch, q_len, args.max_model_len, device)
        # (first the engine's own setting: its splits, the kernel's tile and stages)
        settings = [(default, None, None)]
        if not args.engine_only:
            settings += itertools.product(ints(args.splits), ints(args.tiles), ints(args.stages))
        for ns, tile, stages in settings:
            run = functools.partial(
                paged_attention,
                query, kv[0], kv[1], out, table, lens, qsl, batch, batch * q_len, q_len,
                args.max_model_len, args.head_dim**-0.5, ns, tile_n=tile, num_stages=stages,
            )  # fmt: skip

            setting = {"batch": batch, "context": ctx, "queries": q_len, "splits": ns}
            setting.update(tile_n=tile, num_stages=stages, engine_default_splits=default)
            try:
                t = graph_time(run, device, calls=args.layers)
            except Exception as e:  # a setting the compiler refuses
                rows.append({**setting, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            rows.append({**setting, "us": round(t * 1e6, 2)})
    report = {
        "benchmark": "small_batch_attention",
        "heads": [args.heads, args.kv_heads, args.head_dim],
        "max_model_len": args.max_model_len,
        "gpu": hardware(device),
        "commit": commit(),
        "rows": rows,
    }
    name = f"small-batch-attention-h{args.heads}-kv{args.kv_heads}-{args.max_model_len}"
    path = save_report(report, f"{name}-{report['commit']}", args.output_json)
    # Each case: the engine's setting against the fastest.
    print(f"{'batch':>5}{'ctx':>6}{'q':>3}  {'engine':>22}  {'fastest':>28}")
    for key, group in itertools.groupby(rows, lambda r: (r["batch"], r["context"], r["queries"])):
        ok = [r for r in group if "us" in r]
        if not ok:
            continue
        eng = [r for r in ok if r["tile_n"] is None]
        best = min(ok, key=lambda r: r["us"])
        e = f"{eng[0]['splits']}s {eng[0]['us']:.2f}us" if eng else "-"
        b = f"{best['splits']}s t{best['tile_n']} st{best['num_stages']} {best['us']:.2f}us"
        b = b.replace("tNone stNone", "(engine)")
        print(f"{key[0]:>5}{key[1]:>6}{key[2]:>3}  {e:>22}  {b:>28}")
    print(json.dumps({"results": str(path)}))


if __name__ == "__main__":
    main()
