"""FP8 on one GPU (issue 46): accuracy of FP8 weights (W8A8) and an FP8 KV cache against bf16 on
real weights, and speed on a Llama-3.1-8B shape; one JSON.

    python benchmarks/fp8.py --accuracy \
        --output-json benchmarks/results/fp8-accuracy-smollm2-<gpu>-<commit>.json
    python benchmarks/fp8.py --speed \
        --output-json benchmarks/results/fp8-speed-llama-3.1-8b-<gpu>-<commit>.json

- ``--accuracy``: SmolLM2-135M-Instruct (the default model's GGUF), teacher-forced over the
  public-domain text of ``benchmarks/data/public_domain.txt`` (``--positions``, default every
  position: about 2,800 in windows of ``--context`` 1,024 tokens). Each position's next-token
  distribution comes from the engine itself (a logits processor records the full distribution
  of a request whose prompt is the text up to that position; prefix caching makes each such
  request compute its last block only, reading the rest from the cache, FP8 included). Engines:
  ``bf16`` (the reference), ``fp8-weights`` (``quantization: fp8``), ``fp8-kv``
  (``kv_cache_dtype: fp8``) and ``fp8`` (both). Figures: top-1 agreement with bf16 and the mean
  KL(bf16 || case). The issue's bar, for ``fp8``: agreement >= 0.97, mean KL < 0.02.
- ``--speed``: Llama-3.1-8B-shaped random weights (``benchmarks/configs/llama-3.1-8b``),
  workload c (256 requests, 128 prompt tokens, 1,024 output tokens, greedy), output tokens/s of
  ``bf16`` and ``fp8`` (FP8 weights and KV cache), each engine in a process of its own, and
  their ratio (the bar: 1.6). Then the FP8 decode kernels at batch 256 alone (every linear of a
  layer with its activation quantization, and the Triton attention over an FP8 cache at the
  workload's mean context), replayed from CUDA graphs, against their floor
  ``max(bytes / copy bandwidth, FLOPs / FP8 peak)``: measured over floor per kernel and for the
  layer (the bar: 1.3).

Each part stays under about four minutes on an H200. The JSON is written as each part (and
each engine) ends: a part that fails leaves its ``error`` there beside the figures before it,
and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pagoda.bench.random_weights import config_folder
from pagoda.bench.report import commit
from pagoda.plugins import PLUGIN_API_VERSION, hookimpl

TEXT = Path(__file__).parent / "data" / "public_domain.txt"
LLAMA_8B = Path(__file__).parent / "configs" / "llama-3.1-8b"
ACCURACY_CASES = {
    "bf16": {},
    "fp8-weights": {"quantization": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}
SPEED_CASES = {"bf16": {}, "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
# Workload c (pagoda.bench.workloads): decode-heavy, Llama-3.1-8B.
WORKLOAD_C = {"requests": 256, "prompt_len": 128, "output_len": 1024}
#: Dense FP8 tensor-core peaks (FLOP/s) by device name, where the name says which: the floor's
#: compute side (``--fp8-peak-tflops`` for others).
FP8_PEAKS = {"H200": 1979e12, "H100 80GB HBM3": 1979e12, "H100 PCIe": 1513e12,
             "H100 NVL": 1671e12, "L40S": 733e12, "L4": 242.5e12}  # fmt: skip
DECODE_BATCH = 256


# ---- accuracy -----------------------------------------------------------------------------------


class _Recorder:
    """A plugin whose logits processor keeps every sampled row's log-probabilities (float32, on
    the device) by request id."""

    PAGODA_PLUGIN_API = PLUGIN_API_VERSION

    def __init__(self) -> None:
        self.rows: dict[str, object] = {}

    @hookimpl
    def logits_processors(self, config, vocab_size, device):
        recorder = self

        def record(logits, md):
            lp = logits.float().log_softmax(dim=-1)
            for i, req in enumerate(md.req_ids):
                recorder.rows[req] = lp[i].clone()
            return logits

        return [record]


def _windows(ids: list[int], context: int, positions: int | None) -> list[list[int]]:
    """The text cut into windows of ``context`` tokens (the last one shorter), so that the
    positions predicted total ``positions`` (None: all)."""
    wins = [ids[i : i + context] for i in range(0, len(ids), context) if len(ids) - i > 1]
    if positions is None:
        return wins
    out, left = [], positions
    for w in wins:
        if left <= 0:
            break
        out.append(w[: left + 1])
        left -= len(out[-1]) - 1
    return out


def run_accuracy_case(case: str, context: int, positions: int | None, result: Path) -> None:
    """One engine: every position's next-token log-probabilities, saved as a tensor file."""
    import torch

    from pagoda import LLM, SamplingParams
    from pagoda.loader import load_tokenizer, resolve_model
    from pagoda.plugins import plugin_registered

    recorder = _Recorder()
    resolved = resolve_model(None, "auto")
    tok = load_tokenizer(resolved.hf_dir)
    ids = tok(TEXT.read_text())["input_ids"]
    wins = _windows(ids, context, positions)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    out_rows, targets = [], []
    # One attention backend for every case (FlashInfer reads no FP8 cache): the cases then
    # differ by their FP8 arithmetic alone.
    backend = "triton" if torch.cuda.is_available() else "torch_native"
    with plugin_registered(recorder, "fp8-accuracy-recorder"):
        llm = LLM(model=None, dtype="bfloat16", max_model_len=context + 8,
                  enable_prefix_caching=True, attention_backend=backend,
                  **ACCURACY_CASES[case])  # fmt: skip
        try:
            for w in wins:
                # The whole window first: its blocks are cached (and an FP8 cache's scales are
                # computed from real text: the first prompt sets them), then each prefix.
                llm.generate([{"prompt_token_ids": w}], one, use_tqdm=False)
                recorder.rows.clear()
                prompts = [{"prompt_token_ids": w[: n + 1]} for n in range(len(w) - 1)]
                outs = llm.generate(prompts, one, use_tqdm=False)
                out_rows += [recorder.rows[o.request_id].cpu() for o in outs]
                targets += w[1:]
        finally:
            llm.engine.shutdown()
    torch.save({"logprobs": torch.stack(out_rows), "targets": torch.tensor(targets)}, result)


def accuracy(args: argparse.Namespace, tmp: Path, rows: dict, save: Callable[[], None]) -> None:
    """Fills ``rows`` (the report's ``accuracy``) once every case has run."""
    import torch

    parts = {}
    for case in ACCURACY_CASES:
        out = tmp / f"{case}.pt"
        cmd = [sys.executable, __file__, "--one-accuracy", case, "--context", str(args.context),
               "--result", str(out)]  # fmt: skip
        if args.positions:
            cmd += ["--positions", str(args.positions)]
        print(f"fp8 accuracy: {case}", flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        parts[case] = torch.load(out)
        parts[case]["seconds"] = round(time.perf_counter() - t0, 1)
    ref = parts["bf16"]["logprobs"]
    targets = parts["bf16"]["targets"]
    rows.update({"positions": int(ref.shape[0]), "context": args.context, "text": TEXT.name})
    rows["bf16_next_token_accuracy"] = round((ref.argmax(-1) == targets).float().mean().item(), 4)
    for case, part in parts.items():
        if case == "bf16":
            continue
        lp = part["logprobs"]
        agree = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        kl = (ref.exp() * (ref - lp)).sum(-1).clamp(min=0)
        rows[case] = {
            "top1_agreement_with_bf16": round(agree, 4),
            "mean_kl_from_bf16": round(kl.mean().item(), 5),
            "p99_kl_from_bf16": round(kl.quantile(0.99).item(), 4),
            "next_token_accuracy": round((lp.argmax(-1) == targets).float().mean().item(), 4),
            "seconds": part["seconds"],
        }
    rows["bar"] = {"top1_agreement": 0.97, "mean_kl": 0.02}
    rows["passes"] = (
        rows["fp8"]["top1_agreement_with_bf16"] >= 0.97 and rows["fp8"]["mean_kl_from_bf16"] < 0.02
    )


# ---- speed --------------------------------------------------------------------------------------


def run_speed_case(case: str, folder: Path, result: Path) -> None:
    """One engine on workload c: output tokens/s, and its steady decode steps' time."""
    from pagoda import LLM, SamplingParams
    from pagoda.bench import roofline
    from pagoda.bench.workloads import make_prompts
    from pagoda.plugins import plugin_registered

    wl = WORKLOAD_C
    recorder = roofline.StepRecorder()
    out: dict = {"case": case, **SPEED_CASES[case]}
    with plugin_registered(recorder, "fp8-bench-steps"):
        t0 = time.perf_counter()
        llm = LLM(model=str(folder), load_format="dummy", dtype="bfloat16", max_num_seqs=256,
                  max_model_len=wl["prompt_len"] + wl["output_len"],
                  max_num_batched_tokens=8192, **SPEED_CASES[case])  # fmt: skip
        out["startup_s"] = round(time.perf_counter() - t0, 1)
        out["attention_backend"] = (
            llm.engine.engine_core.executor.worker.model_runner.attn_backend.name
        )
        try:
            warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            first = list(range(100, 100 + wl["prompt_len"]))
            llm.generate([{"prompt_token_ids": first}] * 8, warm, use_tqdm=False)
            vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
            prompts = make_prompts(
                wl["requests"], wl["prompt_len"], wl["prompt_len"], vocab, 0, avoid=set()
            )
            params = SamplingParams(max_tokens=wl["output_len"], temperature=0.0, ignore_eos=True)
            recorder.steps.clear()
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)  # fmt: skip
            elapsed = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            out["workload_c"] = {"output_tokens": tokens, "elapsed_s": round(elapsed, 2),
                                 "output_tokens_per_s": round(tokens / elapsed, 1)}  # fmt: skip
            iv = roofline.decode_intervals(recorder.steps, DECODE_BATCH)
            if iv:
                out["decode_b256"] = {
                    "steps": len(iv),
                    "step_ms": round(statistics.median(t for t, _ in iv) * 1e3, 3),
                    "mean_context": round(statistics.fmean(c for _, c in iv) / DECODE_BATCH, 1),
                }
        finally:
            llm.engine.shutdown()
    result.write_text(json.dumps(out))


def head_dim(cfg: dict) -> int:
    """A config's ``head_dim``; Llama's configs leave it out when it is ``hidden_size //
    num_attention_heads`` (Llama-3.1-8B's: 128)."""
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def linear_steps(cfg: dict, batch: int, device, layers: int = 8) -> list[dict]:
    """The linears of a layer at ``batch`` decode tokens: for each, its label, shape ``[m, k,
    n]`` and a ``step`` that runs it ``layers`` times over weights of its own (with its
    activation quantization), what a decode step reads: 8 layers' weights are past the L2
    cache."""
    import torch

    from pagoda.ops.fp8 import fp8_linear, quantize_rows

    h, inter, head = cfg["hidden_size"], cfg["intermediate_size"], head_dim(cfg)
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    g = torch.Generator(device=device).manual_seed(0)
    shapes = {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * inter, h),
              "down_proj": (h, inter)}  # fmt: skip
    out = []
    for label, (n, k) in shapes.items():
        ws = [quantize_rows(torch.randn(n, k, generator=g, device=device) / k**0.5)
              for _ in range(layers)]  # fmt: skip
        x = torch.randn(batch, k, generator=g, device=device).to(torch.bfloat16)

        def step(ws=ws, x=x) -> None:
            for wq, sc in ws:
                fp8_linear(x, wq, sc.view(-1))

        out.append({"kernel": label, "shape": [batch, k, n], "step": step, "layers": layers})
    return out


def attention_step(cfg: dict, batch: int, ctx: int, device) -> dict:
    """The Triton backend's decode over an FP8 cache at batch ``batch``, every request at
    context ``ctx``: its ``step`` and the bytes it must move (``moved``)."""
    import numpy as np
    import torch
    from pagoda_attention_triton.backend import TritonAttentionBackend

    from pagoda.attention.backend import CommonAttentionMetadata

    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    bs = 16
    per_req = -(-ctx // bs)
    num_blocks = batch * per_req + 1
    cache = torch.zeros((2, num_blocks, bs, kv_heads, d), dtype=torch.float8_e4m3fn,
                        device=device)  # fmt: skip
    perm = np.random.default_rng(0).permutation(np.arange(1, num_blocks)).astype(np.int32)
    table = torch.from_numpy(perm.reshape(batch, per_req)).to(device)
    seq_lens = np.full(batch, ctx, dtype=np.int64)
    qsl = np.arange(batch + 1, dtype=np.int64)
    slots = table[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs
    common = CommonAttentionMetadata(
        num_reqs=batch, num_actual_tokens=batch, max_query_len=1, max_seq_len=ctx,
        query_start_loc=torch.from_numpy(qsl).to(device, torch.int32),
        seq_lens=torch.from_numpy(seq_lens).to(device, torch.int32), block_table=table,
        slot_mapping=slots, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, block_size=bs,
    )  # fmt: skip
    md = TritonAttentionBackend.build_graph_metadata(common)
    TritonAttentionBackend.prepare_graph_replay(md, common)
    impl = TritonAttentionBackend.get_impl_cls()(heads, d, d**-0.5, kv_heads)
    impl.k_scale = torch.ones(1, device=device)
    impl.v_scale = torch.ones(1, device=device)
    g = torch.Generator(device=device).manual_seed(1)
    qkv = [torch.randn(batch, n, d, generator=g, device=device).to(torch.bfloat16)
           for n in (heads, kv_heads, kv_heads)]  # fmt: skip
    moved = batch * ctx * kv_heads * d * 2 + batch * (heads + 2 * kv_heads + heads) * d * 2
    return {
        "kernel": "attention (triton, fp8 KV)",
        "context": ctx,
        "step": lambda: impl.forward(*qkv, cache, md),
        "moved": moved,
    }


def run_kernels(result: Path, peak_tflops: float | None) -> None:
    """The FP8 decode kernels of one Llama-3.1-8B layer at batch 256, each against its floor."""
    import torch

    from pagoda.bench.device import copy_bandwidth, graph_time

    cfg = json.loads((LLAMA_8B / "config.json").read_text())
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = (
        peak_tflops * 1e12
        if peak_tflops
        else next((v for k, v in FP8_PEAKS.items() if k in name), None)
    )
    if peak is None:
        raise SystemExit(f"no FP8 peak known for {name!r}: pass --fp8-peak-tflops")
    bandwidth = copy_bandwidth(device)
    m = DECODE_BATCH
    rows = []
    for lin in linear_steps(cfg, m, device):
        _, k, n = lin["shape"]
        seconds = graph_time(lin["step"], device, iters=20) / lin["layers"]
        moved = n * k + m * k * 2 + m * n * 2 + n * 4  # FP8 weight, bf16 in and out, scales
        floor = max(moved / bandwidth, 2 * m * n * k / peak)
        rows.append({"kernel": lin["kernel"], "shape": lin["shape"],
                     "us": round(seconds * 1e6, 2), "floor_us": round(floor * 1e6, 2),
                     "over_floor": round(seconds / floor, 3)})  # fmt: skip
    # Workload c's mean context: prompt plus half the output.
    att = attention_step(cfg, m, WORKLOAD_C["prompt_len"] + WORKLOAD_C["output_len"] // 2, device)
    seconds = graph_time(att["step"], device, iters=20)
    floor = att["moved"] / bandwidth
    rows.append({"kernel": att["kernel"], "context": att["context"],
                 "us": round(seconds * 1e6, 2), "floor_us": round(floor * 1e6, 2),
                 "over_floor": round(seconds / floor, 3)})  # fmt: skip
    total = sum(r["us"] for r in rows)
    total_floor = sum(r["floor_us"] for r in rows)
    result.write_text(json.dumps({
        "gpu": name, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "fp8_peak_tflops": round(peak / 1e12, 1), "batch": m, "kernels": rows,
        "layer_us": round(total, 2), "layer_floor_us": round(total_floor, 2),
        "layer_over_floor": round(total / total_floor, 3), "bar": 1.3,
    }))  # fmt: skip


def speed(args: argparse.Namespace, tmp: Path, report: dict, save: Callable[[], None]) -> None:
    """Fills ``report`` (the report's ``speed``) as each part ends, saving it each time: the
    engines' figures stay in the JSON when the kernels part fails after them (it then holds
    ``kernels_b256: {"error": ...}``)."""
    folder = config_folder(LLAMA_8B, tmp)
    report.update({"model": "llama-3.1-8b (random weights)", "workload": "c", **WORKLOAD_C})
    for case in SPEED_CASES:
        out = tmp / f"{case}.json"
        print(f"fp8 speed: {case}", flush=True)
        subprocess.run([sys.executable, __file__, "--one-speed", case, "--folder", str(folder),
                        "--result", str(out)], check=True)  # fmt: skip
        report[case] = json.loads(out.read_text())
        print(json.dumps({case: report[case]}), flush=True)
        save()
    tps = {c: report[c]["workload_c"]["output_tokens_per_s"] for c in SPEED_CASES}
    report["fp8_over_bf16"] = round(tps["fp8"] / tps["bf16"], 3)
    report["bar_fp8_over_bf16"] = 1.6
    save()
    out = tmp / "kernels.json"
    print("fp8 speed: decode kernels at batch 256", flush=True)
    cmd = [sys.executable, __file__, "--one-kernels", "--result", str(out)]
    if args.fp8_peak_tflops:
        cmd += ["--fp8-peak-tflops", str(args.fp8_peak_tflops)]
    rc = subprocess.run(cmd).returncode
    if rc != 0 or not out.exists():
        report["kernels_b256"] = {
            "error": f"the kernels part exited with status {rc} (its traceback is in the log)"
        }
    else:
        report["kernels_b256"] = json.loads(out.read_text())
    save()


def _summary(report: dict) -> dict:
    summary: dict = {}
    a = report.get("accuracy") or {}
    if "passes" in a:
        summary["accuracy"] = {c: a[c] for c in ACCURACY_CASES if c != "bf16"}
        summary["accuracy"]["passes"] = a["passes"]
    s = report.get("speed") or {}
    if all(c in s for c in SPEED_CASES):
        summary["speed"] = {
            "output_tokens_per_s": {
                c: s[c]["workload_c"]["output_tokens_per_s"] for c in SPEED_CASES
            },  # fmt: skip
            "fp8_over_bf16": s.get("fp8_over_bf16"),
        }
        k = s.get("kernels_b256") or {}
        if "kernels" in k:
            summary["speed"]["kernels_over_floor"] = {
                r["kernel"]: r["over_floor"] for r in k["kernels"]
            }
            summary["speed"]["layer_over_floor"] = k["layer_over_floor"]
    errors = {
        part: r["error"]
        for part, r in (("accuracy", a), ("speed", s), ("kernels", s.get("kernels_b256") or {}))
        if "error" in r
    }
    if errors:
        summary["errors"] = errors
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accuracy", action="store_true", help="FP8 against bf16 on SmolLM2")
    ap.add_argument("--speed", action="store_true", help="workload c and the decode kernels")
    ap.add_argument("--output-json", type=Path)
    ap.add_argument("--context", type=int, default=1024, help="tokens a window holds")
    ap.add_argument("--positions", type=int, help="positions to predict (default: all)")
    ap.add_argument("--fp8-peak-tflops", type=float, help="dense FP8 peak, for an unknown GPU")
    ap.add_argument("--one-accuracy", choices=list(ACCURACY_CASES), help=argparse.SUPPRESS)
    ap.add_argument("--one-speed", choices=list(SPEED_CASES), help=argparse.SUPPRESS)
    ap.add_argument("--one-kernels", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_accuracy:  # children: one engine (or the kernels) in this process
        run_accuracy_case(args.one_accuracy, args.context, args.positions, args.result)
        return 0
    if args.one_speed:
        run_speed_case(args.one_speed, args.folder, args.result)
        return 0
    if args.one_kernels:
        run_kernels(args.result, args.fp8_peak_tflops)
        return 0
    if not (args.accuracy or args.speed):
        ap.error("say --accuracy, --speed or both")
    if args.output_json is None:
        ap.error("--output-json is required")
    report: dict = {
        "benchmark": "fp8",
        "command": " ".join(["python benchmarks/fp8.py", *sys.argv[1:]]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
    }

    def save() -> None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")

    # Each part's figures are saved as they come; a part that fails records its error and the
    # next part still runs.
    with tempfile.TemporaryDirectory() as tmp:
        for part, run in (("accuracy", accuracy), ("speed", speed)):
            if getattr(args, part):
                report[part] = {}
                try:
                    run(args, Path(tmp), report[part], save)
                except Exception as e:  # noqa: BLE001 (recorded; the exit status says so)
                    report[part]["error"] = f"{type(e).__name__}: {e}"
                    print(f"fp8 {part} failed: {report[part]['error']}", file=sys.stderr)
                save()
    summary = _summary(report)
    print(json.dumps(summary, indent=2))
    return 1 if "errors" in summary else 0


if __name__ == "__main__":
    raise SystemExit(main())
