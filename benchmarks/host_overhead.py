"""The host's share of a step: many requests decoding on a tiny random model, on the CPU.

The model (benchmarks/configs/tiny-llama) computes almost nothing, so the time per step is mostly
what the host does for every request: scheduling, preparing the batch, sampling bookkeeping,
detokenizing and building outputs. On a GPU this work overlaps the device's step; once it takes
longer than the device, it sets the pace (small models at large batches). ``--compare`` also runs
the Python detokenizer window in place of tokenizers' ``DecodeStream``.

    python benchmarks/host_overhead.py [--requests 256] [--output-len 64] [--compare]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

import pagoda.engine.detokenizer as detokenizer
from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.bench.report import commit, hardware, save_report

CONFIG = Path(__file__).parent / "configs" / "tiny-llama"


def _ms_per_step(llm: LLM, prompts: list[dict], params: SamplingParams, repeats: int) -> float:
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return best / params.max_tokens * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compare", action="store_true", help="also the Python detokenizer window")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    folder, _ = ensure_random_weights(CONFIG, 0, torch.device("cpu"))
    llm = LLM(
        model=str(folder),
        device="cpu",
        max_num_seqs=args.requests,
        max_model_len=args.input_len + args.output_len + 8,
        max_num_batched_tokens=max(2048, args.requests * args.input_len),
    )
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(10, 200, args.input_len).tolist()}
        for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rows = {"decode_stream": _ms_per_step(llm, prompts, params, args.repeats)}
    if args.compare:
        stream = detokenizer.DecodeStream
        detokenizer.DecodeStream = None  # new requests decode their window in Python
        try:
            rows["python_window"] = _ms_per_step(llm, prompts, params, args.repeats)
        finally:
            detokenizer.DecodeStream = stream
    llm.engine.shutdown()

    report = {
        "benchmark": "host_overhead",
        "requests": args.requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "hardware": hardware(torch.device("cpu")),
        "commit": commit(),
        "ms_per_step": {k: round(v, 3) for k, v in rows.items()},
    }
    name = f"host-overhead-r{args.requests}-cpu-{report['commit']}"
    path = save_report(report, name, args.output_json)
    print(f"{args.requests} requests on a tiny model, {report['hardware']}:")
    for name, ms in rows.items():
        print(f"  {name:<14}{ms:8.2f} ms a step (best of {args.repeats})")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
