"""The random draw at a temperature: the sampler's separate passes against the one-kernel draw.

Times, on the device's clock, what a step that samples at a temperature alone runs after the LM
head: the sampler's path (logits to float32, over the temperature, softmax, bucket sums, running
sums, searches) and ``pagoda.ops.sample_from_logits`` (one Triton kernel), on bfloat16 logits of a
vocabulary (Qwen3's 151,936 by default) for several batch sizes, and counts the rows where the two
pick different tokens (only a uniform within float rounding of a boundary between tokens can).

    python benchmarks/fused_draw.py [--vocab 151936] [--batches 1,64,256]
"""

from __future__ import annotations

import argparse
import functools

import torch

from pagoda.bench.device import time_fn
from pagoda.bench.report import commit, hardware, save_report
from pagoda.ops.triton_sample import sample_from_logits_triton
from pagoda.sample.ops import sample_from_probs


def _sampler_path(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor):
    probs = logits.float().div_(temperature.unsqueeze(1)).softmax(dim=-1)
    return sample_from_probs(probs, uniform)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        logits = (4 * torch.randn(b, args.vocab, device=device, generator=gen)).bfloat16()
        temperature = torch.full((b,), 0.6, device=device)
        uniform = torch.rand(b, device=device, generator=gen, dtype=torch.float64)
        args_b = (logits, temperature, uniform)
        torch_us = time_fn(functools.partial(_sampler_path, *args_b), 50, device) * 1e6
        fused_us = time_fn(functools.partial(sample_from_logits_triton, *args_b), 50, device) * 1e6
        differ = 0
        for seed in range(20):
            u = torch.rand(b, device=device, dtype=torch.float64, generator=gen.manual_seed(seed))
            a = _sampler_path(logits, temperature, u)
            f = sample_from_logits_triton(logits, temperature, u)
            differ += int((a != f).sum())
        rows.append(
            {
                "batch": b,
                "sampler_us": round(torch_us, 1),
                "fused_us": round(fused_us, 1),
                "speedup": round(torch_us / fused_us, 2),
                "rows_drawn": 20 * b,
                "rows_differing": differ,
            }
        )
    report = {
        "benchmark": "fused_draw",
        "vocab": args.vocab,
        "gpu": hardware(device),
        "commit": commit(),
        "rows": rows,
    }
    path = save_report(report, f"fused-draw-v{args.vocab}", args.output_json)
    print(f"vocabulary {args.vocab}, bfloat16 logits, temperature 0.6")
    print(f"{'batch':>6}{'sampler us':>12}{'fused us':>10}{'speedup':>9}{'differ':>8}")
    for r in rows:
        print(
            f"{r['batch']:>6}{r['sampler_us']:>12.1f}{r['fused_us']:>10.1f}{r['speedup']:>9.2f}"
            f"{r['rows_differing']:>4}/{r['rows_drawn']}"
        )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
