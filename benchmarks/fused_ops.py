"""Fused-op benchmark: each of the model's fused Triton kernels against the torch code it replaces,
at Llama-3.1-8B's and Qwen3-0.6B's shapes, then whole decode forwards of a few-layer random
Qwen3-0.6B with fused ops off and on.

Ops run 1, 64, 256 and 8192 tokens in bf16. Each figure is the median over repeats of the mean time
of a run of calls, measured with CUDA events: "graph" replays the calls from a CUDA graph (GPU time
only, as decode steps run), "eager" launches them from Python (launch overhead included, as prefill
runs).

    python benchmarks/fused_ops.py [--layers 4] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import torch

import pagoda.ops as ops
from pagoda.bench.report import commit as report_commit
from pagoda.bench.report import hardware, save_report
from pagoda.loader import ModelArchConfig
from pagoda.ops import reference

CONFIGS = Path(__file__).parent / "configs"
MODELS = ("llama-3.1-8b", "qwen3-0.6b")
TOKENS = (1, 64, 256, 8192)
DTYPE = torch.bfloat16
INNER, REPEATS = 20, 15


def _arch(name: str) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(json.loads((CONFIGS / name / "config.json").read_text()))


def _time(fn: Callable[[], object], graph: bool) -> float:
    """Median seconds per call of ``fn``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compile, autotune, allocate
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)

    def run() -> None:
        for _ in range(INNER):
            fn()  # results are dropped, so their memory is reused (in a graph's pool too)

    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000 / INNER)
    return statistics.median(times)


def _op_cases(a: ModelArchConfig, n: int) -> dict[str, tuple[Callable, Callable]]:
    """op name -> (torch call, fused call) on fresh inputs of ``n`` tokens."""
    from pagoda.models.layers import RotaryEmbedding
    from pagoda.ops.triton_activation import silu_and_mul_triton
    from pagoda.ops.triton_norm import rms_norm_triton
    from pagoda.ops.triton_rotary import rotary_embedding_triton

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=DTYPE)

    h, eps, hd = a.hidden_size, a.rms_norm_eps, a.head_dim
    x, res, w = rand(n, h), rand(n, h), rand(h)
    gate_up = rand(n, 2 * a.intermediate_size)
    q_size, kv_size = a.num_attention_heads * hd, a.num_key_value_heads * hd
    q, k, _ = rand(n, q_size + 2 * kv_size).split([q_size, kv_size, kv_size], -1)
    q, k = q.view(n, -1, hd), k.view(n, -1, hd)
    rope = RotaryEmbedding(hd, a.max_position_embeddings, a.rope_theta, a.rope_scaling).cuda()
    pos = torch.randint(0, a.max_position_embeddings, (n,), device="cuda")
    wh = rand(hd)
    cases = {
        "add_rms_norm": (
            lambda: reference.rms_norm(x, w, eps, res),
            lambda: rms_norm_triton(x, w, eps, res),
        ),
        "rms_norm": (lambda: reference.rms_norm(x, w, eps), lambda: rms_norm_triton(x, w, eps)),
        "silu_and_mul": (
            lambda: reference.silu_and_mul(gate_up),
            lambda: silu_and_mul_triton(gate_up),
        ),
        "rotary": (
            lambda: reference.rotary_embedding(pos, q, k, rope.cos, rope.sin),
            lambda: rotary_embedding_triton(pos, q, k, rope.cos, rope.sin),
        ),
    }
    if a.qk_norm:
        cases["qk_norm"] = (
            lambda: (reference.rms_norm(q, wh, eps), reference.rms_norm(k, wh, eps)),
            lambda: (rms_norm_triton(q, wh, eps), rms_norm_triton(k, wh, eps)),
        )
    return cases


def bench_ops() -> list[dict]:
    rows = []
    for name in MODELS:
        a = _arch(name)
        for n in TOKENS:
            for op, (torch_fn, fused_fn) in _op_cases(a, n).items():
                row = {"op": op, "model": name, "tokens": n}
                for mode in ("graph", "eager"):
                    t, f = _time(torch_fn, mode == "graph"), _time(fused_fn, mode == "graph")
                    row[f"{mode}_torch_us"] = round(t * 1e6, 2)
                    row[f"{mode}_fused_us"] = round(f * 1e6, 2)
                    row[f"{mode}_speedup"] = round(t / f, 2)
                rows.append(row)
            torch.cuda.empty_cache()
    return rows


def _decode_model(layers: int, batch: int, context: int):
    """A random Qwen3-0.6B-shaped model of ``layers`` layers, its KV caches and a decode step's
    attention metadata for ``batch`` requests of ``context`` tokens."""
    from pagoda.attention.backend import CommonAttentionMetadata
    from pagoda.attention.layer import Attention
    from pagoda.models.llama import LlamaForCausalLM
    from pagoda.plugins import get_registry

    cfg = json.loads((CONFIGS / "qwen3-0.6b" / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    a = ModelArchConfig.from_hf_config(cfg)
    registry = get_registry("attention_backends")
    backend = registry.get("triton" if "triton" in registry.names() else "torch_native")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(a, backend).eval()
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    page = 16
    per_req = -(-context // page)
    shape = backend.get_kv_cache_shape(batch * per_req + 1, page, a.num_key_value_heads, a.head_dim)
    for m in model.modules():
        if isinstance(m, Attention):
            m.kv_cache = torch.zeros(shape, dtype=DTYPE, device="cuda")
    block_table = (torch.arange(batch * per_req, device="cuda") + 1).view(batch, per_req).int()
    seq_lens = np.full(batch, context, dtype=np.int64)
    qsl = np.arange(batch + 1, dtype=np.int64)
    slots = block_table[:, (context - 1) // page].long() * page + (context - 1) % page
    common = CommonAttentionMetadata(
        num_reqs=batch,
        num_actual_tokens=batch,
        max_query_len=1,
        max_seq_len=context,
        query_start_loc=torch.from_numpy(qsl).int().cuda(),
        seq_lens=torch.from_numpy(seq_lens).int().cuda(),
        block_table=block_table,
        slot_mapping=slots,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=page,
    )
    ids = torch.randint(0, a.vocab_size, (batch,), device="cuda")
    positions = torch.full((batch,), context - 1, device="cuda")
    return model, backend, common, ids, positions


def bench_decode(layers: int, batch: int) -> dict:
    from pagoda.attention.layer import set_forward_context

    model, backend, common, ids, positions = _decode_model(layers, batch, 1024)
    md = backend.build_metadata(common)

    def forward() -> torch.Tensor:
        with torch.inference_mode(), set_forward_context(md):
            return model(ids, positions)

    row = {"op": "decode_forward", "model": f"qwen3-0.6b-{layers}-layers", "tokens": batch}
    for mode in ("graph", "eager"):
        if mode == "graph" and not backend.supports_cuda_graph:
            continue
        times = {}
        for fused in (False, True):
            ops.set_fused_ops(fused)
            times[fused] = _time(forward, mode == "graph")
        ops.set_fused_ops(True)
        row[f"{mode}_torch_us"] = round(times[False] * 1e6, 2)
        row[f"{mode}_fused_us"] = round(times[True] * 1e6, 2)
        row[f"{mode}_speedup"] = round(times[False] / times[True], 2)
    row["attention_backend"] = backend.name
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="layers of the decode-forward model")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fused_ops.py times CUDA kernels: no CUDA device found")
    if find_spec("triton") is None:
        raise SystemExit("benchmarks/fused_ops.py times Triton kernels: triton is not installed")
    device = torch.device("cuda")
    rows = bench_ops() + [bench_decode(args.layers, b) for b in (1, 64, 256)]
    commit = report_commit()
    gpu = hardware(device)
    report = {
        "benchmark": "fused_ops",
        "gpu": gpu,
        "commit": commit,
        "dtype": "bfloat16",
        "method": f"CUDA events, median of {REPEATS} runs of {INNER} calls after warm-up",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": rows,
    }
    tag = gpu.replace("NVIDIA ", "").split()[0].lower()
    path = save_report(report, f"fused-ops-{tag}-{commit}", args.output_json)
    print(f"{gpu}, commit {commit}; graph: GPU time, eager: with launches; us per call")
    print(
        f"{'op':<16}{'shape':<24}{'tokens':>7}{'torch':>10}{'fused':>10}{'speedup':>9}{'eager':>8}"
    )
    for r in rows:
        mode = "graph" if "graph_torch_us" in r else "eager"
        print(
            f"{r['op']:<16}{r['model']:<24}{r['tokens']:>7}{r[f'{mode}_torch_us']:>10}"
            f"{r[f'{mode}_fused_us']:>10}{r[f'{mode}_speedup']:>9}{r['eager_speedup']:>8}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
