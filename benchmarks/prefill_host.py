"""The host's time in a batch-1 prefill step, split by the model's parts, and one kernel
launch's host time.

A prefill runs eagerly (decode steps replay CUDA graphs), so its host time is Python and kernel
launches: some six Triton kernels and four linears a layer. On a small model at batch 1 that
time, not the device's, is the prefill's (the time to a request's first token, and a fixed cost
of every request, which thins the gain of anything that speeds up decoding). Random weights of
``--random-weights`` (SmolLM2-135M's config by default), ``--num-prompts`` prompts of
``--input-len`` random tokens, each generated alone to one token; each part's host time is
taken by wrapping its ``forward`` (parts nest: a decoder layer holds its norms). With
``--jit-only`` every Triton kernel launches through the JIT's own binding, as before
``pagoda.ops.launch.JitLaunch``. ``outputs`` is a digest of the greedy tokens of three prompts
(24 tokens each), equal between the two modes where launches run the same kernels.

    python benchmarks/prefill_host.py [--jit-only] [--input-len 600]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spec_decode as sd  # noqa: E402 (the benchmark's workload helpers)

from pagoda import SamplingParams  # noqa: E402
from pagoda.bench.report import commit, hardware, save_report  # noqa: E402


def _targets(llm: Any) -> list[tuple[Any, str, str]]:
    import pagoda.attention.layer as attention_layer
    import pagoda.models.layers as layers
    import pagoda.models.llama as llama
    import pagoda.models.parallel_layers as parallel

    runner = runner_of(llm)
    targets = [
        (llm.engine, "step", "engine_step"),
        (runner, "launch", "runner.launch"),
        (runner, "_update_states", "update_states"),
        (runner, "_sample", "sample"),
        (layers.RMSNorm, "forward", "RMSNorm"),
        (layers.RotaryEmbedding, "forward", "RotaryEmbedding"),
        (parallel.ColumnParallelLinear, "forward", "ColumnParallelLinear"),
        (parallel.RowParallelLinear, "forward", "RowParallelLinear"),
        (attention_layer.Attention, "forward", "Attention"),
        (llama, "silu_and_mul", "silu_and_mul"),
    ]
    for name in ("LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP"):
        if hasattr(llama, name):
            targets.append((getattr(llama, name), "forward", name))
    layer = runner.model.model.layers[0]
    targets.append((type(layer.self_attn.attn.impl), "forward", "attention backend"))
    targets.append((runner.piecewise, "run", "piecewise graphs"))
    return targets


def runner_of(llm: Any) -> Any:
    return llm.engine.engine_core.executor.worker.model_runner


def measure(llm: Any, prompts: list[dict]) -> dict[str, Any]:
    """Host microseconds per prefill of each part, and its calls per prefill."""
    from pagoda.bench.timeline import timed

    spent: dict[str, int] = collections.defaultdict(int)
    calls: collections.Counter = collections.Counter()

    def record(label: str, start: int, end: int) -> None:
        spent[label] += end - start
        calls[label] += 1

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    wall = []
    with timed(_targets(llm), record):
        for p in prompts:
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate([p], params, use_tqdm=False)
            wall.append(time.perf_counter() - start)
    n = len(prompts)
    order = sorted(spent, key=lambda label: -spent[label])
    return {
        "wall_ms_per_request_median": round(sorted(wall)[n // 2] * 1e3, 2),
        "host_us_per_prefill": {k: round(spent[k] / 1e3 / n, 1) for k in order},
        "calls_per_prefill": {k: calls[k] / n for k in order},
    }


def launch_host_us(input_len: int) -> dict[str, float]:
    """One call's host time (1,000 calls, not waited for) of a few ops at a prefill's shape."""
    import torch.nn.functional as F

    from pagoda.ops import silu_and_mul
    from pagoda.ops.triton_norm import rms_norm_triton

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(input_len, 576, device=dev, dtype=dt)
    w = torch.ones(576, device=dev, dtype=dt)
    weight = torch.randn(1536, 576, device=dev, dtype=dt) * 0.02
    g = torch.randn(input_len, 3072, device=dev, dtype=dt)
    cases = {
        "rms_norm_triton": lambda: rms_norm_triton(x, w, 1e-5),
        "rms_norm_triton, residual": lambda: rms_norm_triton(x, w, 1e-5, residual=x),
        "silu_and_mul": lambda: silu_and_mul(g),
        "F.linear": lambda: F.linear(x, weight),
        "x + x": lambda: x + x,
    }
    out = {}
    for name, f in cases.items():
        for _ in range(50):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(1000):
            f()
        out[name] = round((time.perf_counter() - t) * 1e3, 2)  # (ms per 1,000 = us per call)
        torch.cuda.synchronize()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = Path(__file__).resolve().parent
    p.add_argument("--random-weights", default=str(here / "configs" / "smollm2-135m"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=600)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--jit-only", action="store_true", help="every launch through Triton's JIT")
    p.add_argument(
        "--piecewise-graph-max-tokens",
        type=int,
        default=None,
        help="model.piecewise_graph_max_tokens (0: prefills run eagerly); default: the engine's",
    )
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_host.py measures a GPU's host path: it needs CUDA")
    if args.piecewise_graph_max_tokens is not None:
        os.environ["PAGODA_MODEL__PIECEWISE_GRAPH_MAX_TOKENS"] = str(
            args.piecewise_graph_max_tokens
        )
    if args.jit_only:
        from pagoda.ops import launch

        launch.JitLaunch.__call__ = lambda self, grid, *a, **k: self.fn[grid](*a, **k)
    ns = argparse.Namespace(
        model=None, random_weights=args.random_weights, device="cuda", dtype=args.dtype,
        prompts="random", num_prompts=args.num_prompts + 3, kinds=None,
        input_len=args.input_len, max_tokens=1, max_model_len=2048, batch_size=1,
        kv_cache_memory_bytes=2 << 30,
    )  # fmt: skip
    sd.use_random_weights(ns)
    llm = sd._build(ns, None)
    prompts, _ = sd.workload_prompts(ns, llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts[:3], greedy, use_tqdm=False)  # (also the warm-up)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    report = {
        "benchmark": "prefill_host",
        "command": "python benchmarks/prefill_host.py " + " ".join(sys.argv[1:]),
        "hardware": hardware(torch.device("cuda")),
        "commit": commit(),
        "model": f"random weights of {Path(args.random_weights).name}",
        "dtype": args.dtype,
        "input_len": args.input_len,
        "num_prompts": args.num_prompts,
        "launches": "jit" if args.jit_only else "JitLaunch",
        "piecewise_graph_max_tokens": runner_of(llm).config.model.piecewise_graph_max_tokens,
        "piecewise_graphs_used": runner_of(llm).piecewise is not None,
        "outputs": hashlib.md5(str(tokens).encode()).hexdigest(),
        **measure(llm, prompts[3:]),
        "one_launch_host_us": launch_host_us(args.input_len),
    }
    mode = "jit" if args.jit_only else "jitlaunch"
    if not report["piecewise_graphs_used"]:
        mode += "-eager"
    name = f"prefill-host-{Path(args.random_weights).name}-{mode}"
    path = save_report(report, name, args.output_json)
    print(f"wall ms per request (median): {report['wall_ms_per_request_median']}")
    for k in ("host_us_per_prefill", "one_launch_host_us"):
        print(k)
        for part, us in report[k].items():
            print(f"  {part:>28}: {us}")
    print(f"outputs {report['outputs']}\nresults: {path}")


if __name__ == "__main__":
    main()
