"""The Triton decode attention on an engine's own inputs, timed apart from the step.

Runs an engine (random weights, eager, 256 requests) until its first decode step of the whole
batch, keeps one layer's attention inputs of that step (query, cache, block table, lengths,
order), then times the kernel on them replayed from a CUDA graph, and again with the query made
contiguous, with the same lengths over blocks at random places in the cache, and with the exact
longest context. Against the step's own kernel time (``profile_decode.py``) it separates what the
inputs cost from what running inside the step costs.

    python benchmarks/attention_apart.py [--config qwen3-0.6b] [--min-input-len 100]
        [--input-len 1024]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from pagoda_attention_triton import backend as triton_backend
from pagoda_attention_triton.kernels import paged_attention

from pagoda import LLM, SamplingParams
from pagoda.bench.device import copy_bandwidth, graph_time
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.bench.report import commit, hardware, save_report

CONFIGS = Path(__file__).parent / "configs"
BATCH = 256


def _capture(args) -> tuple:
    folder, _ = ensure_random_weights(CONFIGS / args.config, 0, torch.device("cuda"))
    llm = LLM(
        model=str(folder),
        max_num_seqs=BATCH,
        max_model_len=args.input_len + 200,
        attention_backend="triton",
        enforce_eager=True,  # the backend's forward runs from Python each step
    )
    engine = llm.engine
    vocab = engine.info.shape.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    for i in range(BATCH):
        n = int(rng.integers(args.min_input_len, args.input_len + 1))
        ids = rng.integers(100, vocab - 100, n).tolist()
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    kept: dict = {}
    forward = triton_backend.TritonAttentionImpl.forward

    def keeping(self, query, key, value, kv_cache, md):
        out = forward(self, query, key, value, kv_cache, md)
        c = md.common
        if not kept and c.max_query_len == 1 and c.num_reqs == BATCH:
            order = None if md.order is None else md.order.clone()
            kept["args"] = (
                query.clone(), kv_cache[0], kv_cache[1], c.block_table.clone(),
                c.seq_lens.clone(), c.query_start_loc.clone(), c.num_reqs, c.num_actual_tokens,
                c.max_seq_len, self.scale, md.num_splits, order,
            )  # fmt: skip
        return out

    triton_backend.TritonAttentionImpl.forward = keeping
    try:
        for _ in range(200):
            engine.step()
            if kept:
                break
    finally:
        triton_backend.TritonAttentionImpl.forward = forward
    if not kept:
        raise SystemExit("no decode step of the whole batch within 200 steps")
    return kept["args"], llm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen3-0.6b", help="folder under benchmarks/configs")
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    (q, k, v, bt, lens, qsl, reqs, tokens, max_len, scale, splits, order), _llm = _capture(args)
    dev = q.device
    bw = copy_bandwidth(dev)
    lens_cpu = lens[:reqs].cpu()
    kv_bytes = int(lens_cpu.sum()) * k.shape[2] * k.shape[3] * 2 * k.element_size()
    out = torch.empty_like(q)

    def graph_s(query, table, longest: int) -> float:
        def run() -> None:
            paged_attention(
                query, k, v, out, table, lens, qsl, reqs, tokens, 1, longest, scale, splits,
                order=order,
            )  # fmt: skip

        return graph_time(run, dev, calls=10)

    used = (lens_cpu + k.shape[1] - 1) // k.shape[1]
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(k.shape[0] - 1, generator=g)[: int(used.sum())] + 1
    scattered = torch.zeros_like(bt, device="cpu")
    off = 0
    for i, n in enumerate(used.tolist()):
        scattered[i, :n] = perm[off : off + n]
        off += n
    cases = {
        "engine inputs": (q, bt, max_len),
        "contiguous query": (q.contiguous(), bt, max_len),
        "blocks at random places": (q, scattered.to(dev), max_len),
        "exact longest context": (q, bt, int(lens_cpu.max())),
    }
    rows = []
    print(
        f"{args.config}: {reqs} requests, mean context {float(lens_cpu.float().mean()):.0f}, "
        f"splits {splits}, ordered {order is not None}; copy bandwidth {bw / 1e9:.0f} GB/s"
    )
    for name, (query, table, longest) in cases.items():
        t = graph_s(query, table, longest)
        share = kv_bytes / t / bw
        rows.append({"case": name, "us": round(t * 1e6, 1), "of_copy_bw": round(share, 3)})
        print(f"  {name:<26}{t * 1e6:8.1f} us {share:7.3f} of the copy bandwidth")
    report = {
        "benchmark": "attention_apart",
        "config": args.config,
        "batch": reqs,
        "mean_context": round(float(lens_cpu.float().mean()), 1),
        "gpu": hardware(dev),
        "commit": commit(),
        "copy_bandwidth_GBps": round(bw / 1e9, 1),
        "rows": rows,
    }
    save_report(report, f"attention-apart-{args.config}-b{reqs}", args.output_json)


if __name__ == "__main__":
    main()
