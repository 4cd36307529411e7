"""A mixture of experts on one GPU: Qwen3-30B-A3B-shaped random weights (bfloat16), the native
MoE model against the same model through transformers' own grouped-GEMM experts, and the fused
MoE operator's decode reads against the device's copy bandwidth; one JSON.

    python benchmarks/moe.py \
        --output-json benchmarks/results/moe-qwen3-30b-a3b-<gpu>-<commit>.json

- ``nano``: nano-vllm's workload (256 requests, prompts and outputs of 100 to 1,024 tokens,
  temperature 0.6), output tokens/s of ``model_impl`` native, transformers with its
  ``grouped_mm`` experts (and, with ``--cases``, transformers with Pagoda's fused operator);
  each engine in a process of its own, one after the other, with the same random weights
  (drawn by Pagoda).
  Then, on the native engine, decode steps at batch 64 and 256 (steady steps timed between their
  ends) against the bytes such a step must read: attention, router, LM head, the KV cache, and
  the experts the batch routes to.
- ``kernel``: the fused operator alone at batch 64 and 256, eight layers' experts (past any
  cache) replayed in a CUDA graph: the routed experts' weights it reads over its time, as a
  fraction of the measured copy bandwidth (the issue's bar: 0.65).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagoda.bench.random_weights import config_folder
from pagoda.bench.report import commit

CONFIG = Path(__file__).parent / "configs" / "qwen3-30b-a3b"
CASES = {
    "native": ("native", None),
    "transformers-grouped_mm": ("transformers", "grouped_mm"),
    "transformers-pagoda": ("transformers", None),
}
DECODE_BATCHES = (64, 256)


def _expert_bytes(cfg: dict) -> int:
    return 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2


def _distinct_experts(num: int, top_k: int, batch: int) -> float:
    """Experts a batch routes to, expected, when each token picks ``top_k`` of ``num`` at
    random (random weights route so)."""
    return num * (1 - (1 - top_k / num) ** batch)


def _step_bytes(cfg: dict, batch: int, context_tokens: int) -> float:
    """What a decode step of ``batch`` must read: every weight but the embedding and the
    unrouted experts, and the KV cache of ``context_tokens``."""
    h, layers, head = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    attention = h * (q + 2 * kv) + q * h + 2 * head + 2 * h
    router = cfg["num_experts"] * h
    experts = _distinct_experts(cfg["num_experts"], cfg["num_experts_per_tok"], batch)
    per_layer = (attention + router) * 2 + experts * _expert_bytes(cfg)
    kv_bytes = context_tokens * layers * 2 * kv * 2
    return layers * per_layer + cfg["vocab_size"] * h * 2 + h * 2 + kv_bytes


def run_engine(case: str, folder: Path) -> dict:
    """One engine on the nano workload, then its steady decode steps at each batch."""
    import torch

    from pagoda import LLM, SamplingParams
    from pagoda.bench import roofline
    from pagoda.bench.device import copy_bandwidth
    from pagoda.bench.workloads import nano_draws
    from pagoda.plugins import plugin_registered

    impl, experts = CASES[case]
    if experts is not None:
        # NOTE: transformers' own grouped GEMM, the baseline: the plugin asks its experts module
        # which implementation to use when it builds the model, in this process.
        import pagoda_models_transformers.model as tf_model

        tf_model.experts_implementation = lambda: experts
    cfg = json.loads((folder / "config.json").read_text())
    bandwidth = copy_bandwidth(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    recorder = roofline.StepRecorder()
    out: dict = {"case": case, "model_impl": impl}
    with plugin_registered(recorder, "moe-bench-steps"):
        t0 = time.perf_counter()
        llm = LLM(model=str(folder), load_format="dummy", dtype="bfloat16", model_impl=impl,
                  max_num_seqs=256, max_model_len=2048, max_num_batched_tokens=16384)  # fmt: skip
        out["startup_s"] = round(time.perf_counter() - t0, 1)
        # (each phase as it ends: a run stopped by a time limit still says where its time went)
        print(f"  {case}: engine up in {out['startup_s']} s", flush=True)
        try:
            warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            llm.generate([{"prompt_token_ids": list(range(100, 164))}] * 4, warm, use_tqdm=False)
            prompts, out_lens = nano_draws(256, 0, 100, 1024)
            params = [SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True)
                      for n in out_lens]  # fmt: skip
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)  # fmt: skip
            elapsed = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            out["nano"] = {"output_tokens": tokens, "elapsed_s": round(elapsed, 2),
                           "output_tokens_per_s": round(tokens / elapsed, 1)}  # fmt: skip
            print(f"  {case}: nano {out['nano']}", flush=True)
            out["decode"] = []
            for b in DECODE_BATCHES:
                recorder.steps.clear()
                new = 64 + roofline.STEADY_STATE_DROP + 8
                prompts = [[(7 * i + j) % 10000 + 100 for j in range(512)] for i in range(b)]
                greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
                llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
                iv = roofline.decode_intervals(recorder.steps, b)
                if not iv:
                    out["decode"].append({"batch": b, "note": "no steady decode steps"})
                    continue
                step_s = statistics.median(t for t, _ in iv)
                context = statistics.median(c for _, c in iv)
                need = _step_bytes(cfg, b, int(context))
                out["decode"].append({
                    "batch": b,
                    "steps": len(iv),
                    "step_ms": round(step_s * 1e3, 3),
                    "bytes_read_gb": round(need / 1e9, 3),
                    "fraction_of_copy_bandwidth": round(need / step_s / bandwidth, 3),
                })  # fmt: skip
        finally:
            llm.engine.shutdown()
    out["copy_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    return out


def run_kernel() -> dict:
    """The fused operator alone at each decode batch (see the module docstring)."""
    import torch

    from pagoda.bench.device import copy_bandwidth
    from pagoda.ops import fused_experts
    from pagoda.ops.fused_moe import route
    from pagoda.ops.triton_fused_moe import pick_config

    cfg = json.loads((CONFIG / "config.json").read_text())
    num, top_k = cfg["num_experts"], cfg["num_experts_per_tok"]
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    layers = 8  # 8 x 128 experts x 9.4 MiB: no cache holds them
    g = torch.Generator(device=device).manual_seed(0)
    w13 = [(torch.randn(num, 2 * inter, h, generator=g, device=device) * h**-0.5).bfloat16()
           for _ in range(layers)]  # fmt: skip
    w2 = [(torch.randn(num, h, inter, generator=g, device=device) * inter**-0.5).bfloat16()
          for _ in range(layers)]  # fmt: skip
    rows = []
    for b in DECODE_BATCHES:
        x = torch.randn(b, h, generator=g, device=device).bfloat16()
        routes = [route(torch.randn(b, num, generator=g, device=device), top_k) for _ in w13]
        for _ in range(2):  # compile, then warm
            for i in range(layers):
                fused_experts(x, w13[i], w2[i], *routes[i])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(layers):
                fused_experts(x, w13[i], w2[i], *routes[i])
        graph.replay()
        torch.cuda.synchronize()
        reps = 50
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        per_layer_s = start.elapsed_time(end) / 1e3 / reps / layers
        distinct = statistics.fmean(int(ids.unique().numel()) for _, ids in routes)
        read = distinct * _expert_bytes(cfg)
        rows.append({
            "batch": b,
            "distinct_experts_per_layer": distinct,
            "launch_config": pick_config(b, w13[0], top_k, torch.bfloat16),
            "per_layer_us": round(per_layer_s * 1e6, 2),
            "routed_expert_bytes_mb": round(read / 1e6, 2),
            "fraction_of_copy_bandwidth": round(read / per_layer_s / bandwidth, 3),
        })  # fmt: skip
    return {"copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "decode": rows,
            "gpu": torch.cuda.get_device_name(device)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json", type=Path)
    ap.add_argument(
        "--cases",
        nargs="+",
        default=["native", "transformers-grouped_mm"],
        choices=list(CASES),
        help="engines on the nano workload (default: native and transformers' grouped_mm)",
    )
    ap.add_argument("--skip-engines", action="store_true", help="the kernel part only")
    ap.add_argument("--one", choices=[*CASES, "kernel"], help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a child: one engine (or the kernel) in this process
        result = run_kernel() if args.one == "kernel" else run_engine(args.one, args.folder)
        args.result.write_text(json.dumps(result))
        return 0
    if args.output_json is None:
        ap.error("--output-json is required")
    report: dict = {
        "benchmark": "moe",
        "command": " ".join(["python benchmarks/moe.py", *sys.argv[1:]]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "model": "qwen3-30b-a3b (random weights, bfloat16)",
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = config_folder(CONFIG, Path(tmp))
        todo = ["kernel"] + ([] if args.skip_engines else args.cases)
        for case in todo:
            out = Path(tmp) / f"{case}.json"
            cmd = [sys.executable, __file__, "--one", case, "--folder", str(folder),
                   "--result", str(out)]  # fmt: skip
            print(f"moe benchmark: {case}", flush=True)
            subprocess.run(cmd, check=True)
            report[case] = json.loads(out.read_text())
            # NOTE: each part as it ends, and the JSON so far: a run stopped midway keeps them.
            print(json.dumps({case: report[case]}), flush=True)
            args.output_json.parent.mkdir(parents=True, exist_ok=True)
            args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    tps = {c: report[c]["nano"]["output_tokens_per_s"] for c in CASES if c in report}
    if "native" in tps and "transformers-grouped_mm" in tps:
        report["native_over_transformers_grouped_mm"] = round(
            tps["native"] / tps["transformers-grouped_mm"], 3
        )
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    summary = {
        "nano_output_tokens_per_s": tps,
        "native_over_transformers_grouped_mm": report.get("native_over_transformers_grouped_mm"),
        "kernel_fraction_of_copy_bandwidth": {
            r["batch"]: r["fraction_of_copy_bandwidth"] for r in report["kernel"]["decode"]
        },
        "native_decode_fraction_of_copy_bandwidth": {
            r["batch"]: r.get("fraction_of_copy_bandwidth")
            for r in report.get("native", {}).get("decode", [])
        },
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
