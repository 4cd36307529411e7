"""LoRA decode kernels, one step of Qwen3-0.6B's projections (issue 45): each decode kernel of
``pagoda.ops.lora.DECODE_KERNELS`` against the base linears alone, replayed in a CUDA graph as
the engine's decode steps are.

    python benchmarks/lora_kernels.py --output-json benchmarks/results/lora-kernels-<gpu>.json

A step is every decoder layer's (28) four projections at ``--tokens`` rows (64): q|k|v (1024 to
2048 | 1024 | 1024), o (2048 to 1024), gate|up (1024 to 3072 | 3072) and down (3072 to 1024),
bfloat16, each followed by its adapters' product (rank ``--rank`` 16, ``--slots`` 8, row i on
slot i mod 8) through ``pagoda.ops.lora.add_lora``. Printed: microseconds a step of the base
linears alone, then of the base and each kernel (and what LoRA adds), also with every row on
no adapter (what a base-model batch costs an engine with LoRA on); each kernel's output is
first checked against the torch reference; ``--sweep`` also times the fused kernels at other
blocks of output columns (``block_n``). Each projection's weights are laid out as the engine's
``LoRALinear`` holds them: every slot's A stacked under the base weight, the base weight and A
views of it; ``folded`` runs one GEMM over the stacked weight (the base output and every slot's
shrink, in the weights' dtype) and ``pagoda.ops.lora.expand_folded``, the others the GEMM over
the base rows and ``add_lora``. Then where ``bgmv``'s time goes (its shrinks alone, its expands
alone). The last line names the fastest kernel: the value of ``DECODE_KERNEL`` in
``core/src/pagoda/ops/lora.py`` it would take (``PAGODA_LORA_DECODE_KERNEL`` selects one
without an edit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from pagoda.bench.device import graph_time
from pagoda.bench.report import commit, hardware, save_report
from pagoda.ops import linear, triton_lora
from pagoda.ops import lora as ops

CONFIG = Path(__file__).parent / "configs" / "qwen3-0.6b" / "config.json"
DTYPE = torch.bfloat16
ENV = "PAGODA_LORA_DECODE_KERNEL"


def _layers(cfg: dict, rank: int, slots: int, device: torch.device) -> list[list[tuple]]:
    """Each layer's projections: (input width, W, A, B, bounds, the stacked W | A), random and
    scaled so that the outputs stay near 1; W and A are views of the stacked weight."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = [(h, (q, kv, kv)), (q, (h,)), (h, (i, i)), (i, (h,))]  # qkv, o, gate_up, down
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(DTYPE)

    layers = []
    for _ in range(cfg["num_hidden_layers"]):
        projections = []
        for k, parts in shapes:
            n = sum(parts)
            bounds = tuple(np.cumsum(parts[:-1]).tolist())
            stacked = torch.cat([rand(n, k, scale=k**-0.5),
                                 rand(slots * len(parts) * rank, k, scale=k**-0.5)])  # fmt: skip
            w, a = stacked[:n], stacked[n:].view(slots, len(parts) * rank, k)
            b = rand(slots, n, rank, scale=rank**-0.5)
            projections.append((k, w, a, b, bounds, stacked))
        layers.append(projections)
    return layers


def _batch(token_slots: np.ndarray, slots: int, device: torch.device) -> ops.LoRABatch:
    order, starts = ops.sort_rows(token_slots, slots)
    i32 = {"dtype": torch.int32, "device": device}
    return ops.LoRABatch(
        torch.tensor(token_slots, **i32), torch.zeros(1, **i32), torch.zeros(1, **i32), 1, [],
        use_rows=True, sorted_rows=torch.tensor(order, **i32),
        slot_starts=torch.tensor(starts, **i32),
    )  # fmt: skip


def _set_slots(batch: ops.LoRABatch, token_slots: np.ndarray, slots: int) -> None:
    order, starts = ops.sort_rows(token_slots, slots)
    batch.token_slots.copy_(torch.from_numpy(token_slots))
    batch.sorted_rows.copy_(torch.from_numpy(order))
    batch.slot_starts.copy_(torch.from_numpy(starts))


def _reference(x, a, b, bounds, batch, base: torch.Tensor) -> torch.Tensor:
    """``base`` (float32) plus every row's adapter product, by the torch reference."""
    want = base.float().clone()
    y = ops.bgmv_shrink_reference(x, a, batch.token_slots)
    edges = (0, *bounds, b.shape[1])
    r = b.shape[2]
    for j, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        ops.bgmv_expand_reference(y, b[:, lo:hi], batch.token_slots, want[:, lo:hi], j * r)
    return want


def _error(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor) -> float:
    """The largest error of ``got`` against ``want``, relative to the largest adapter delta."""
    delta = (want - base.float()).abs().max().item()
    return (got.float() - want).abs().max().item() / max(delta, 1e-6)


def _project(x, projection, batch, kernel: str, bases: list | None = None) -> torch.Tensor:
    """One projection with the decode kernel ``kernel``, as the engine's ``LoRALinear`` runs it
    in a rows step; ``bases`` (:func:`_check`): gets a copy of the base output it started from."""
    k, w, a, b, bounds, stacked = projection
    if kernel == "folded":
        n = w.shape[0]
        y = linear(x, stacked)
        if bases is not None:
            bases.append(y[:, :n].clone())
        ops.expand_folded(y, n, b, batch, bounds, a.shape[1])
        return y[:, :n]
    y = linear(x, w)
    if bases is not None:
        bases.append(y.clone())
    ops.add_lora(x, a, b, batch, y, bounds, kernel=kernel)
    return y


def _check(layers, inputs, batch, kernel: str) -> float:
    """The largest error of ``kernel`` against the torch reference over layer 0's projections,
    relative to the largest delta."""
    worst = 0.0
    for projection in layers[0]:
        k, w, a, b, bounds, _ = projection
        x = inputs[k]
        bases: list[torch.Tensor] = []
        got = _project(x, projection, batch, kernel, bases)
        base = bases[0]
        worst = max(worst, _error(got, _reference(x, a, b, bounds, batch, base), base))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--kernels", nargs="+", default=list(ops.DECODE_KERNELS),
                    choices=ops.DECODE_KERNELS)  # fmt: skip
    ap.add_argument("--iters", type=int, default=100, help="graph replays a trial")
    ap.add_argument("--trials", type=int, default=5, help="the median trial is reported")
    ap.add_argument("--sweep", action="store_true", help="also the fused kernels' block_n")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    device = torch.device("cuda")
    t_start = time.perf_counter()
    cfg = json.loads(CONFIG.read_text())
    layers = _layers(cfg, args.rank, args.slots, device)
    g = torch.Generator(device=device).manual_seed(1)
    widths = {p[0] for p in layers[0]}
    inputs = {k: torch.randn(args.tokens, k, generator=g, device=device).to(DTYPE) for k in widths}
    spread = (np.arange(args.tokens) % args.slots).astype(np.int32)
    none = np.full(args.tokens, -1, dtype=np.int32)
    batch = _batch(spread, args.slots, device)

    shrunk = {p[0]: torch.randn(args.tokens, p[2].shape[1], generator=g, device=device)
              for p in layers[0]}  # fmt: skip

    def step(kernel: str | None, block_n: int | None) -> None:
        for projections in layers:
            for projection in projections:
                k, w, a, b, bounds, _ = projection
                if kernel in ops.DECODE_KERNELS and block_n is None:
                    _project(inputs[k], projection, batch, kernel)
                    continue
                y = linear(inputs[k], w)
                if kernel is None:
                    continue
                if kernel == "shrink-only":
                    triton_lora.bgmv_shrink(inputs[k], a, batch.token_slots)
                    continue
                if kernel == "expand-only":
                    triton_lora.bgmv_expand(shrunk[k], b, batch.token_slots, y, bounds)
                    continue
                if kernel == "fused-rows":
                    triton_lora.fused_rows(inputs[k], a, b, batch.token_slots, y, bounds, block_n)
                else:
                    triton_lora.fused_slots(inputs[k], a, b, batch.sorted_rows,
                                            batch.slot_starts, y, bounds, block_n)  # fmt: skip

    def us(kernel: str | None, block_n: int | None = None) -> float:
        times = [graph_time(lambda: step(kernel, block_n), device, iters=args.iters)
                 for _ in range(args.trials)]  # fmt: skip
        return statistics.median(times) * 1e6

    base = us(None)
    print(f"base linears only: {base:8.1f} us a step")
    results: dict = {}
    for kernel in args.kernels:
        _set_slots(batch, spread, args.slots)
        error = _check(layers, inputs, batch, kernel)
        if error > 0.05:
            raise SystemExit(f"{kernel}: off the torch reference by {error:.3f} of the delta")
        t = us(kernel)
        _set_slots(batch, none, args.slots)
        idle = us(kernel)
        results[kernel] = {"us_per_step": round(t, 1), "lora_us": round(t - base, 1),
                           "no_adapter_rows_lora_us": round(idle - base, 1),
                           "max_rel_error": round(error, 4)}  # fmt: skip
        print(f"base + {kernel:<12} {t:8.1f} us a step (LoRA {t - base:6.1f} us; "
              f"rows without adapters: {idle - base:6.1f} us)")  # fmt: skip
    # Where bgmv's time goes: its shrinks alone, its expands alone.
    _set_slots(batch, spread, args.slots)
    candidates: dict = {}
    for name in ("shrink-only", "expand-only"):
        t = us(name)
        candidates[name] = {"us_per_step": round(t, 1), "lora_us": round(t - base, 1)}
        print(f"base + {name:<12} {t:8.1f} us a step (LoRA {t - base:6.1f} us)")
    sweep: dict = {}
    _set_slots(batch, spread, args.slots)
    for kernel in [k for k in ("fused-rows", "fused-slots") if args.sweep and k in results]:
        for block_n in (64, 128, 256, 512):
            t = us(kernel, block_n)
            sweep[f"{kernel} block_n={block_n}"] = round(t - base, 1)
            print(f"  {kernel:<12} block_n={block_n:<4} LoRA {t - base:6.1f} us a step")
    best = min(results, key=lambda k: results[k]["us_per_step"])
    print(
        f"fastest: {best} (LoRA {results[best]['lora_us']} us a step over the base); the default"
        f' in core/src/pagoda/ops/lora.py: DECODE_KERNEL = os.environ.get("{ENV}", "{best}")'
    )
    report = {
        "benchmark": "lora_kernels",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "gpu": hardware(device),
        "shapes": f"qwen3-0.6b, {cfg['num_hidden_layers']} layers, bfloat16",
        "tokens": args.tokens, "rank": args.rank, "slots": args.slots,
        "base_us_per_step": round(base, 1),
        "kernels": results,
        "candidates": candidates,
        "sweep_lora_us": sweep,
        "fastest": best,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }  # fmt: skip
    if args.output_json:
        save_report(report, "lora_kernels", args.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
