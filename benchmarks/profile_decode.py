"""Where a decode step's time goes: the engine's wall time per step against the GPU time of its
parts, at one batch size on random weights.

A batch of requests is prefilled, then steady decode steps are timed three ways: the wall interval
between ``LLMEngine.step()`` calls (what the throughput benchmark sees), the GPU time of the decode
graph's replay alone and of the logits and sampling alone (CUDA events), and a torch profiler
trace of a few engine steps summed by kernel. Wall well above the GPU parts means the host is the
bottleneck; otherwise the kernel table says which kernels to work on.

    python benchmarks/profile_decode.py [--config llama-3.1-8b] [--batch 256] [--input-len 640]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.bench.report import commit, hardware, save_report

CONFIGS = Path(__file__).parent / "configs"


def _events_ms(fn, iters: int) -> float:
    """Mean GPU milliseconds of ``fn`` over ``iters`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _kernel_table(prof, steps: int, top: int) -> list[dict]:
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name if len(ev.name) <= 90 else ev.name[:87] + "..."
            totals[name] += ev.time_range.elapsed_us()
            counts[name] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    return [
        {"kernel": k, "ms_per_step": round(v / 1e3 / steps, 4), "calls_per_step": counts[k] / steps}
        for k, v in rows[:top]
    ] + [{"kernel": "(all kernels)", "ms_per_step": round(sum(totals.values()) / 1e3 / steps, 4)}]


def _host_table(prof_host, steps: int, top: int = 30, key: str = "tottime_ms") -> list[dict]:
    """A cProfile's functions by their own time (or ``key``), per step."""
    import pstats

    stats = pstats.Stats(prof_host)
    rows = []
    for (file, line, fn), (_, calls, tt, ct, _) in stats.stats.items():
        rows.append(
            {
                "fn": f"{Path(file).name}:{line}({fn})",
                "tottime_ms": round(tt * 1e3 / steps, 4),
                "cumtime_ms": round(ct * 1e3 / steps, 4),
                "calls": round(calls / steps, 2),
            }
        )
    rows.sort(key=lambda r: -r[key])
    return rows[:top]


def _print_host(rows: list[dict], title: str, limit: int = 15) -> None:
    print(f"{title:<70}{'ms':>9}{'cum ms':>9}{'calls':>8}")
    for r in rows[:limit]:
        print(f"{r['fn'][:70]:<70}{r['tottime_ms']:>9.3f}{r['cumtime_ms']:>9.3f}{r['calls']:>8.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="llama-3.1-8b", help="folder under benchmarks/configs")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--input-len", type=int, default=640)
    p.add_argument(
        "--min-input-len",
        type=int,
        default=None,
        help="prompt lengths uniform in [this, --input-len] (default: all --input-len)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0.6 samples as nano's workload")
    p.add_argument(
        "--prefill-profile", action="store_true", help="also profile the prefill steps' kernels"
    )
    p.add_argument(
        "--host-profile", action="store_true", help="also profile the host's work in the steps"
    )
    p.add_argument("--steps", type=int, default=24, help="steady decode steps timed")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--model-impl", default="native", help="the model impl that builds the model")
    p.add_argument("--top", type=int, default=18, help="kernels listed")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    folder, _ = ensure_random_weights(CONFIGS / args.config, 0, torch.device("cuda"))
    b = args.batch
    new_tokens = 3 * args.steps + 64
    llm = LLM(
        model=str(folder),
        max_num_seqs=b,
        max_model_len=args.input_len + new_tokens + 8,
        attention_backend=args.attention_backend,
        model_impl=args.model_impl,
    )
    engine = llm.engine
    vocab = engine.info.shape.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=new_tokens, temperature=args.temperature, ignore_eos=True)
    lo = args.input_len if args.min_input_len is None else args.min_input_len
    for i in range(b):
        ids = rng.integers(100, vocab - 100, int(rng.integers(lo, args.input_len + 1))).tolist()
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    core = engine.engine_core

    # Prefill, then a few decode steps to reach the steady state.
    def prefilling() -> bool:
        reqs = core.scheduler.requests.values()
        return any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs)

    prefill = None
    if args.prefill_profile:
        import cProfile

        walls = []
        first_host = cProfile.Profile()  # the first prefill step apart: it may compile
        rest_host = cProfile.Profile()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as pprof:
            while core.scheduler.requests and prefilling():
                t = time.perf_counter()
                host_prof = rest_host if walls else first_host
                host_prof.enable()
                engine.step()
                host_prof.disable()
                walls.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
        n = len(walls)
        prefill = {
            "step_wall_ms": [round(w, 2) for w in walls],
            "kernels": _kernel_table(pprof, n, args.top),
            "host_first_step": _host_table(first_host, 1, 40, "cumtime_ms"),
            "host_other_steps": _host_table(rest_host, max(n - 1, 1)),
        }
        if args.output_json:  # the whole first-step profile, for pstats
            first_host.dump_stats(str(Path(args.output_json).with_suffix(".first-prefill.prof")))
    while core.scheduler.requests and prefilling():
        engine.step()
    for _ in range(4):
        engine.step()

    step_walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        step_walls.append((time.perf_counter() - t0) * 1e3)
    wall_ms = sum(step_walls) / args.steps
    host = None
    if args.host_profile:
        import cProfile

        prof_host = cProfile.Profile()
        prof_host.enable()
        for _ in range(args.steps):
            engine.step()
        prof_host.disable()
        host = _host_table(prof_host, args.steps)

    runner = core.executor.worker.model_runner
    graphs = runner.decode_graphs
    replays = graphs.replays if graphs is not None else 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        prof_steps = 6
        for _ in range(prof_steps):
            engine.step()
        torch.cuda.synchronize()
    table = _kernel_table(prof, prof_steps, args.top)
    # Whether the profiled decode steps replayed graphs (a step run eagerly shows here as 0).
    graph_replays_per_step = ((graphs.replays if graphs is not None else 0) - replays) / prof_steps
    parts: dict[str, float] = {}
    with torch.inference_mode():
        if graphs is not None and b in graphs.graphs:
            parts["graph_replay_ms"] = _events_ms(graphs.graphs[b].replay, 20)
            hidden = graphs.outputs[b]
        else:
            hidden = torch.randn(
                b, engine.info.shape.hidden_size, device="cuda", dtype=torch.bfloat16
            )
        parts["logits_ms"] = _events_ms(lambda: runner.model.compute_logits(hidden), 20)
        logits = runner.model.compute_logits(hidden)
        parts["argmax_ms"] = _events_ms(lambda: logits.argmax(dim=-1), 20)
    engine.shutdown()

    report = {
        "benchmark": "profile_decode",
        "model": args.config,
        "batch": b,
        "input_len": args.input_len,
        "min_input_len": lo,
        "temperature": args.temperature,
        "attention_backend": args.attention_backend,
        "model_impl": args.model_impl,
        "graph_replays_per_step": graph_replays_per_step,
        "gpu": hardware(torch.device("cuda")),
        "commit": commit(),
        "wall_ms_per_step": round(wall_ms, 3),
        # NOTE: one slow step (a compile, a collection) shows here, apart from the mean.
        "step_wall_ms": [round(w, 3) for w in step_walls],
        "parts_gpu_ms": {k: round(v, 3) for k, v in parts.items()},
        "kernels": table,
        "host_profile_per_step": host,
        "prefill": prefill,
    }
    path = save_report(
        report, f"profile-decode-{args.config}-{args.model_impl}-b{b}", args.output_json
    )
    print(
        f"{args.config} batch {b}, context ~{args.input_len}: wall {wall_ms:.2f} ms a step "
        f"(median {float(np.median(step_walls)):.2f}, slowest {max(step_walls):.2f}); "
        f"model impl {args.model_impl}, {graph_replays_per_step:.2f} graph replays a step"
    )
    for k, v in parts.items():
        print(f"  {k:<18}{v:8.3f} ms")
    print(f"{'kernel':<92}{'ms/step':>9}{'calls':>7}")
    for row in table:
        calls = row.get("calls_per_step")
        calls = "" if calls is None else f"{calls:7.0f}"
        print(f"{row['kernel']:<92}{row['ms_per_step']:>9.3f}{calls}")
    if prefill:
        print(f"prefill steps, wall ms: {prefill['step_wall_ms']}")
        for row in prefill["kernels"]:
            calls = row.get("calls_per_step")
            calls = "" if calls is None else f"{calls:7.0f}"
            print(f"{row['kernel']:<92}{row['ms_per_step']:>9.3f}{calls}")
    if prefill:
        _print_host(prefill["host_first_step"], "host, first prefill step", 40)
        _print_host(prefill["host_other_steps"], "host, other prefill steps (a step)")
    if host:
        _print_host(host, "host, decode (a step)")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
