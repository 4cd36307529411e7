"""How much of a decode step's matrix products could hide behind its attention.

A decode step at batch 256 runs attention (bound by reading the KV cache) and the projections
(bound by compute at these shapes) one after another, layer by layer. Cut in two halves of the
batch on two CUDA streams, one half's attention can run beside the other half's products, at the
price of reading each layer's weights twice. This times, replayed from CUDA graphs, the layers'
attention and four projections (Triton paged attention, cuBLAS products):

- ``serial``: the whole batch, one stream, as the engine runs it now;
- ``two_halves``: two halves, one a stream, the second half a projection behind the first (each
  half's qkv product waits for the other half's previous qkv product, so one half is in its
  attention while the other is in its products);
- the attention alone and the products alone, for the whole batch.

With ``--attention-programs P,...`` the same rows are timed again with attention as a persistent
grid of P programs (each takes every P-th (request, KV head) of the longest-first order), which
leaves the multiprocessors beyond P's for the other half's products.

    python benchmarks/overlap_potential.py [--config qwen3-0.6b] [--batch 256] [--ctx 640]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from pagoda_attention_triton.kernels import _tile, longest_first, paged_attention

from pagoda.bench.device import graph_time
from pagoda.bench.report import commit, hardware, save_report

PAGE = 16
DTYPE = torch.bfloat16
CONFIGS = Path(__file__).parent / "configs"


@triton.jit
def _persistent_decode(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, lens_ptr, order_ptr, scale, num_items, num_programs,
    s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ot, s_oh, s_bt,
    G: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    TILE_N: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
):  # fmt: skip
    """The ordered decode kernel's work (one query a request, a program per (request, KV head)
    in ``order_ptr``'s order) on a grid of ``num_programs``, each looping over its items."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    row_ok = offs_m < G
    d_ok = offs_d < HEAD_DIM
    for item in range(tl.program_id(0), num_items, num_programs):
        seq = tl.load(order_ptr + item // NUM_KV_HEADS)
        kv_head = item % NUM_KV_HEADS
        seq_len = tl.load(lens_ptr + seq)
        head = kv_head * G + offs_m % G
        q = tl.load(
            q_ptr + seq * s_qt + head[:, None] * s_qh + offs_d[None, :], mask=row_ok[:, None]
        )
        q_pos = tl.zeros([BLOCK_M], tl.int32) + (seq_len - 1)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start in range(0, seq_len, TILE_N):
            m_i, l_i, acc = _tile(
                q, q_pos, row_ok, k_ptr, v_ptr, bt_ptr + seq * s_bt, start, seq_len, m_i, l_i,
                acc, offs_n, offs_d, d_ok, kv_head, scale, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh,
                PAGE, "tf32",
            )  # fmt: skip
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        ptrs = out_ptr + seq * s_ot + head[:, None] * s_oh + offs_d[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _persistent(half, k, v, num_programs: int) -> None:
    nkv, hd = k.shape[2], k.shape[3]
    g = half.q.shape[1] // nkv
    items = half.b * nkv
    _persistent_decode[(min(items, num_programs),)](
        half.q, k, v, half.o, half.bt, half.lens, half.order, hd**-0.5, items, num_programs,
        *half.q.stride()[:2], *k.stride()[:3], *v.stride()[:3], *half.o.stride()[:2],
        half.bt.stride(0),
        G=g, BLOCK_M=max(16, triton.next_power_of_2(g)), HEAD_DIM=hd, PAGE=PAGE, TILE_N=64,
        NUM_KV_HEADS=nkv, num_warps=4, num_stages=2,
    )  # fmt: skip


class _Half:
    """One slice of the batch: its queries, contexts, outputs and activations."""

    def __init__(self, lens: torch.Tensor, bt: torch.Tensor, cfg: dict, dev: torch.device):
        b = len(lens)
        self.b = b
        self.lens = lens.int().to(dev)
        self.bt = bt.to(dev)
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.order = torch.from_numpy(longest_first(lens.numpy())).to(dev)
        self.max_len = int(lens.max())
        h, nh, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
        self.x = torch.randn(b, h, dtype=DTYPE, device=dev)
        self.q = torch.randn(b, nh, hd, dtype=DTYPE, device=dev)
        self.o = torch.empty_like(self.q)


def _layer_fns(cfg: dict, kv: torch.Tensor, weights: list, half: _Half, programs: int = 0):
    nh, hd = cfg["num_attention_heads"], cfg["head_dim"]

    def qkv(layer: int) -> None:
        torch.matmul(half.x, weights[layer][0].t())

    def attn(layer: int) -> None:
        if programs:
            _persistent(half, kv[layer, 0], kv[layer, 1], programs)
            return
        paged_attention(
            half.q, kv[layer, 0], kv[layer, 1], half.o, half.bt, half.lens, half.qsl,
            half.b, half.b, 1, half.max_len, hd**-0.5, 1,
            order=half.order if half.b >= 16 else None,
        )  # fmt: skip

    def rest(layer: int) -> None:
        w = weights[layer]
        torch.matmul(half.o.view(half.b, nh * hd), w[1].t())
        gu = torch.matmul(half.x, w[2].t())
        torch.matmul(gu[:, : w[3].shape[1]], w[3].t())

    return qkv, attn, rest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen3-0.6b", help="folder under benchmarks/configs")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ctx", type=int, default=640, help="contexts uniform in [ctx/5, 9 ctx/5]")
    p.add_argument("--equal", action="store_true", help="every context exactly --ctx")
    p.add_argument(
        "--attention-programs", default="", help="persistent attention grids, comma-separated"
    )
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    cfg = json.loads((CONFIGS / args.config / "config.json").read_text())
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    layers, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    nh, nkv, hd, inter = (
        cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
        cfg["intermediate_size"],
    )  # fmt: skip

    g = torch.Generator().manual_seed(0)
    if args.equal:
        lens = torch.full((args.batch,), args.ctx)
    else:
        lens = torch.randint(args.ctx // 5, 9 * args.ctx // 5 + 1, (args.batch,), generator=g)
    blocks = (lens + PAGE - 1) // PAGE
    num_blocks = int(blocks.sum()) + 1
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).int()
    bt = torch.zeros(args.batch, int(blocks.max()), dtype=torch.int32)
    off = 0
    for i, nb in enumerate(blocks.tolist()):
        bt[i, :nb] = perm[off : off + nb]
        off += nb
    kv = torch.randn(layers, 2, num_blocks, PAGE, nkv, hd, dtype=DTYPE, device=dev)
    weights = [
        (
            torch.randn((nh + 2 * nkv) * hd, h, dtype=DTYPE, device=dev) * 0.02,
            torch.randn(h, nh * hd, dtype=DTYPE, device=dev) * 0.02,
            torch.randn(2 * inter, h, dtype=DTYPE, device=dev) * 0.02,
            torch.randn(h, inter, dtype=DTYPE, device=dev) * 0.02,
        )
        for _ in range(layers)
    ]
    whole = _Half(lens, bt, cfg, dev)
    mid = args.batch // 2
    halves = [_Half(lens[:mid], bt[:mid], cfg, dev), _Half(lens[mid:], bt[mid:], cfg, dev)]
    streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]

    def graph_ms(fn) -> float:
        return round(graph_time(fn, dev, iters=20) * 1e3, 3)

    def timed(programs: int) -> dict:
        fw = _layer_fns(cfg, kv, weights, whole, programs)
        fh = [_layer_fns(cfg, kv, weights, hf, programs) for hf in halves]

        def serial() -> None:
            for layer in range(layers):
                for f in fw:
                    f(layer)

        def attention_only() -> None:
            for layer in range(layers):
                fw[1](layer)

        def products_only() -> None:
            for layer in range(layers):
                fw[0](layer)
                fw[2](layer)

        def two_halves() -> None:
            main_stream = torch.cuda.current_stream(dev)
            start = torch.cuda.Event()
            start.record(main_stream)
            qkv_done = [[torch.cuda.Event() for _ in range(layers)] for _ in range(2)]
            for s in streams:
                s.wait_event(start)
            for layer in range(layers):
                for i in range(2):
                    with torch.cuda.stream(streams[i]):
                        if i == 1:  # half 1's qkv after half 0's: half 0 is in attention by then
                            streams[i].wait_event(qkv_done[0][layer])
                        elif layer > 0:  # half 0's next qkv after half 1's last one
                            streams[i].wait_event(qkv_done[1][layer - 1])
                        fh[i][0](layer)
                        qkv_done[i][layer].record(streams[i])
                        fh[i][1](layer)
                        fh[i][2](layer)
            for s in streams:
                main_stream.wait_stream(s)

        row = {"attention_programs": programs or "one a (request, KV head)"}
        row["attention_only"] = graph_ms(attention_only)
        if not programs:
            row["products_only"] = graph_ms(products_only)
        row["serial"] = graph_ms(serial)
        row["two_halves"] = graph_ms(two_halves)
        row["two_halves_over_serial"] = round(row["two_halves"] / row["serial"], 3)
        return row

    programs = [0] + [int(x) for x in args.attention_programs.split(",") if x]
    rows = [timed(n) for n in programs]
    print(f"{args.config} batch {args.batch} ctx {args.ctx}{' equal' if args.equal else ''}")
    for row in rows:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    report = {
        "benchmark": "overlap_potential",
        "config": args.config,
        "batch": args.batch,
        "ctx": args.ctx,
        "equal": args.equal,
        "gpu": hardware(dev),
        "commit": commit(),
        "rows_ms": rows,
    }
    save_report(report, f"overlap-{args.config}-b{args.batch}-c{args.ctx}", args.output_json)


if __name__ == "__main__":
    main()
