"""The host's share of a step: many requests decoding on a tiny random model, on the CPU.

The model (benchmarks/configs/tiny-llama) computes almost nothing, so the time per step is mostly
what the host does for every request: scheduling, preparing the batch, sampling bookkeeping,
detokenizing and building outputs. On a GPU this work overlaps the device's step; once it takes
longer than the device, it sets the pace (small models at large batches). Each row also says how
long the garbage collector ran a step; the ``gc_tuned`` row runs with the collector tuned as the
engine-core process runs it (``pagoda.process``). ``--compare`` also runs the Python
detokenizer window in place of tokenizers' ``DecodeStream``.

    python benchmarks/host_overhead.py [--requests 256] [--output-len 64] [--compare]
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import numpy as np
import torch

import pagoda.engine.detokenizer as detokenizer
from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.bench.report import commit, hardware, save_report
from pagoda.process import tuned_gc

CONFIG = Path(__file__).parent / "configs" / "tiny-llama"


class _GCClock:
    """Seconds inside the garbage collector (its start and stop callbacks) and collections."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._t = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t
            self.collections += 1


def _ms_per_step(
    llm: LLM, prompts: list[dict], params: SamplingParams, repeats: int
) -> tuple[float, float, float]:
    """Best wall time a step, and the collector's time and collections a step (all runs)."""
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    best = float("inf")
    clock = _GCClock()
    gc.callbacks.append(clock)
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
    finally:
        gc.callbacks.remove(clock)
    steps = params.max_tokens * repeats
    return best / params.max_tokens * 1e3, clock.seconds / steps * 1e3, clock.collections / steps


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
    with tuned_gc():  # as the engine-core process of `pagoda serve` runs
        rows["decode_stream_gc_tuned"] = _ms_per_step(llm, prompts, params, args.repeats)
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
        "ms_per_step": {k: round(v[0], 3) for k, v in rows.items()},
        "gc_ms_per_step": {k: round(v[1], 3) for k, v in rows.items()},
        "gc_collections_per_step": {k: round(v[2], 2) for k, v in rows.items()},
    }
    name = f"host-overhead-r{args.requests}-cpu-{report['commit']}"
    path = save_report(report, name, args.output_json)
    print(f"{args.requests} requests on a tiny model, {report['hardware']}:")
    for name, (ms, gc_ms, n) in rows.items():
        print(
            f"  {name:<24}{ms:8.2f} ms a step (best of {args.repeats}), in the collector"
            f" {gc_ms:.2f} ms a step ({n:.1f} collections)"
        )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
