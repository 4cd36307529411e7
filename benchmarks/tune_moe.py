"""Tune the fused MoE kernels' launch configs on this GPU and write them beside the kernel.

For each expert shape (experts, intermediate size per rank, hidden size, top-k) and token count,
every candidate config is timed on the whole operator (alignment, gate/up, down, sum) with
random routing, and the fastest is kept in ``core/src/pagoda/ops/moe_configs/<GPU name>.json``
(merged into what the file holds), which ``pagoda.ops.triton_fused_moe.pick_config`` reads.

    python benchmarks/tune_moe.py                        # Qwen3-30B-A3B's experts
    python benchmarks/tune_moe.py --model mixtral-8x7b --model olmoe-1b-7b
    python benchmarks/tune_moe.py --shape 128,768,2048,8 --tp 2 --tokens 1,64,256

About five minutes a shape on an H200 (most of it compiling the candidates once).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton.testing

from pagoda.ops.fused_moe import route
from pagoda.ops.triton_fused_moe import (
    CONFIG_DIR,
    _device_name,
    config_key,
    fused_experts_triton,
    heuristic_config,
)

#: (experts, intermediate size, hidden size, top-k) of the models the plugin serves.
SHAPES = {
    "qwen3-30b-a3b": (128, 768, 2048, 8),
    "mixtral-8x7b": (8, 14336, 4096, 2),
    "olmoe-1b-7b": (64, 1024, 2048, 8),
}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def candidates(num_tokens: int, top_k: int, experts: int) -> list[dict[str, int]]:
    """Configs worth timing: small row blocks for few rows per expert, larger ones for many."""
    per_expert = num_tokens * top_k / experts
    blocks_m = [16, 32] if per_expert <= 16 else [16, 32, 64, 128]
    out = []
    for bm, bn, bk, warps, stages in itertools.product(
        blocks_m, [64, 128], [64, 128], [4, 8], [3, 4]
    ):
        if bm * bn > 128 * 64 and warps == 4:
            continue
        if (bm + 2 * bn) * bk * 2 * stages > 200 * 1024:  # shared memory of the pipeline
            continue
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                    "num_stages": stages})  # fmt: skip
    return out


def tune_one(shape: tuple[int, int, int, int], num_tokens: int, dtype: torch.dtype) -> dict:
    experts, inter, hidden, top_k = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda") * 0.02).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g, device="cuda") * 0.02).to(dtype)
    x = torch.randn(num_tokens, hidden, generator=g, device="cuda").to(dtype)
    weights, ids = route(torch.randn(num_tokens, experts, generator=g, device="cuda"), top_k)
    best, best_ms = heuristic_config(num_tokens, top_k, experts), float("inf")
    for cfg in candidates(num_tokens, top_k, experts):
        try:
            ms = triton.testing.do_bench(
                lambda cfg=cfg: fused_experts_triton(x, w13, w2, weights, ids, config=cfg),
                warmup=5,
                rep=25,
            )
        except Exception:  # noqa: BLE001 - a config this GPU cannot run (resources)
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return {"config": best, "ms": best_ms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", choices=list(SHAPES), default=None,
                    help="a known model's expert shape (repeatable; default qwen3-30b-a3b)")
    ap.add_argument("--shape", action="append", default=None,
                    help="experts,intermediate,hidden,top_k (repeatable)")  # fmt: skip
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the experts")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape or []]
    shapes += [SHAPES[m] for m in args.model or ([] if shapes else ["qwen3-30b-a3b"])]
    tokens = [int(t) for t in args.tokens.split(",")]
    path = CONFIG_DIR / f"{_device_name(torch.device('cuda'))}.json"
    table = json.loads(path.read_text()) if path.is_file() else {}
    for experts, inter, hidden, top_k in shapes:
        if inter % args.tp:
            raise SystemExit(f"--tp {args.tp} does not split the intermediate size {inter}")
        shape = (experts, inter // args.tp, hidden, top_k)
        key = config_key(*shape[:3], top_k, dtype)
        by_m = table.setdefault(key, {})
        for m in tokens:
            t0 = time.perf_counter()
            found = tune_one(shape, m, dtype)
            by_m[str(m)] = found["config"]
            print(f"{key} tokens={m}: {found['config']} {found['ms'] * 1e3:.1f} us "
                  f"(searched in {time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
            # Written after each token count: a run stopped part way keeps what it found.
            table[key] = dict(sorted(by_m.items(), key=lambda kv: int(kv[0])))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
