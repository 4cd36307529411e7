"""The cost of structured output: JSON-schema-constrained decoding against unconstrained decoding
of the same batch, on random weights (Qwen3-0.6B by default), plus the grammar's compile time,
the cache's hits and the host time each step spends on the bitmask.

The model is random, so constrained requests wander inside the schema (strings, arrays); the
schema asks for at least 100 items, so no request can complete its JSON (and stop) before
``--output-len`` tokens: both runs decode every request to the same length. The tokenizer
must be a real one (``--tokenizer``): the synthetic one of random-weight folders has no JSON
punctuation. Every constrained output is checked against a fresh matcher (each token allowed).

    python benchmarks/structured_output.py --tokenizer DIR [--batch 64] [--output-len 256]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.bench.report import commit, hardware, save_report
from pagoda.sampling_params import StructuredOutputsParams

CONFIGS = Path(__file__).parent / "configs"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "price": {"type": "number"},
                    "kind": {"enum": ["a", "b", "c"]},
                },
                "required": ["id", "name", "tags", "price", "kind"],
            },
            "minItems": 100,
        },
    },
    "required": ["title", "items"],
}


def _relative(value: object) -> object:
    """A path under the working folder as a relative one (reports travel, folders do not)."""
    if isinstance(value, str) and value.startswith(str(Path.cwd()) + "/"):
        return value[len(str(Path.cwd())) + 1 :]
    return value


def _timed(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, list]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def _ms(samples: list[float]) -> dict[str, float | int | None]:
    if not samples:
        return {"mean": None, "p90": None, "steps": 0}
    return {
        "mean": round(1e3 * float(np.mean(samples)), 3),
        "p90": round(1e3 * float(np.percentile(samples, 90)), 3),
        "steps": len(samples),
    }


def _profile(llm: LLM, prompts: list[dict], params: SamplingParams, top: int) -> dict:
    """One pass under cProfile (host functions by own time) and one under the CUDA profiler
    (the share of the pass's wall time that the device was busy)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    seconds, _ = _timed(llm, prompts, params)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    stats = pstats.Stats(prof).stats
    host = sorted(
        (
            {
                "function": f"{Path(f).name}:{line}({fn})",
                "calls": nc,
                "own_s": round(tt, 4),
                "total_s": round(ct, 4),
            }
            for (f, line, fn), (_, nc, tt, ct, _) in stats.items()
        ),
        key=lambda r: -r["own_s"],
    )[:top]
    print(f"--- cProfile of one pass, {params.structured_outputs and 'json_schema' or 'free'}")
    print("\n".join(text.getvalue().splitlines()[: top + 12]))
    result: dict = {"cprofile_pass_s": round(seconds, 3), "host_top": host}
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as cuda_prof:
            seconds, _ = _timed(llm, prompts, params)
            torch.cuda.synchronize()
        spans = sorted(
            (ev.time_range.start, ev.time_range.end)
            for ev in cuda_prof.events()
            if ev.device_type == torch.autograd.DeviceType.CUDA
        )
        busy, end = 0.0, -1.0
        for a, b in spans:  # the union of the device's intervals, in microseconds
            if b > end:
                busy += b - max(a, end)
                end = b
        result["cuda_profiled_pass_s"] = round(seconds, 3)
        result["device_busy_s"] = round(busy / 1e6, 4)
        result["device_busy_share"] = round(busy / 1e6 / seconds, 3)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(CONFIGS / "qwen3-0.6b"))
    p.add_argument("--tokenizer", required=True, help="a folder with the model's tokenizer.json")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--matcher-process",
        choices=["auto", "on", "off"],
        default="auto",
        help="structured_output.matcher_process: the engine's default (auto: a process of their "
        "own on a GPU, a thread on a CPU), a process, or a thread",
    )
    p.add_argument(
        "--host-wait",
        action="store_true",
        help="matchers in their own process: the host waits for their fill before it launches "
        "the sampling (on a GPU the device waits by default)",
    )
    p.add_argument(
        "--sync-mask",
        action="store_true",
        help="no background prefetch: fill each bitmask on the host's path (for comparison)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, one more pass of each kind under cProfile (the N costliest functions "
        "by own time) and under the CUDA profiler (the device's busy share of the pass)",
    )
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.host_wait:
        import pagoda.structured_output.host_flag as host_flag

        host_flag.device_wait_available = lambda device: False
    folder, weights = ensure_random_weights(Path(args.config), 0, device)
    llm = LLM(
        model=str(folder),
        tokenizer=args.tokenizer,
        max_num_seqs=args.batch,
        max_model_len=args.input_len + args.output_len + 16,
        structured_output={
            "matcher_process": {"auto": "auto", "on": True, "off": False}[args.matcher_process]
        },
    )
    core = llm.engine.engine_core
    runner = getattr(core.executor, "worker", None)
    runner = runner.model_runner if runner is not None else None
    if runner is not None and args.sync_mask:
        runner.grammar.prefetch = lambda *a, **k: None
    mask_s: list[float] = []
    if runner is not None:  # the host's time per step in the grammar bitmask
        inner = runner.grammar.mask

        def timed_mask(*a, **k):  # type: ignore[no-untyped-def]
            # NOTE: the wait for the last step's tokens (the device's time) is not counted.
            waited = [0.0]
            wait = a[5]

            def timed_wait() -> None:
                t = time.perf_counter()
                wait()
                waited[0] += time.perf_counter() - t

            t = time.perf_counter()
            try:
                return inner(*a[:5], timed_wait, *a[6:], **k)
            finally:
                mask_s.append(time.perf_counter() - t - waited[0])

        runner.grammar.mask = timed_mask

    # Where the bitmask's time goes: the grammar thread's wait for the step's sampled ids (the
    # device) and its own work (advance the matchers, fill the rows), and how long the runner
    # then waits for that thread (or, matchers in their own process, for its answer).
    if runner is not None and hasattr(runner.grammar, "_prefetch_rows"):  # matchers in a thread
        inner_rows, inner_join = runner.grammar._prefetch_rows, runner.grammar._join

        def timed_rows(items, sampled, event, *rest):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            if event is not None:
                event.synchronize()
            t1 = time.perf_counter()
            inner_rows(items, sampled, None, *rest)
            thread_s.append((t1 - t0, time.perf_counter() - t1))

        def timed_join() -> None:
            t = time.perf_counter()
            inner_join()
            join_s.append(time.perf_counter() - t)

        runner.grammar._prefetch_rows = timed_rows
        runner.grammar._join = timed_join
    elif runner is not None:  # matchers in their own process: the runner's wait for its answer
        inner_drain = runner.grammar._drain

        def timed_drain(wait: bool = True) -> None:
            t = time.perf_counter()
            inner_drain(wait)
            if wait:
                join_s.append(time.perf_counter() - t)

        runner.grammar._drain = timed_drain
    thread_s: list[tuple[float, float]] = []
    join_s: list[float] = []

    rng = np.random.default_rng(0)
    vocab = 100_000
    prompts = [
        {"prompt_token_ids": rng.integers(100, vocab, args.input_len).tolist()}
        for _ in range(args.batch)
    ]
    free = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.output_len,
        temperature=0.0,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    # Warm-up both paths (graphs, kernels, the grammar's first compile).
    manager = core.structured_output
    t0 = time.perf_counter()
    llm.generate(prompts[:2], constrained, use_tqdm=False)
    first_request_s = time.perf_counter() - t0
    compile_times, _, _ = manager.take_stats()
    llm.generate(prompts[:8], free, use_tqdm=False)

    rows: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    tokens: dict[str, int] = {}
    check = None
    mask_s.clear()
    thread_s.clear()
    join_s.clear()
    # The host's waits for the device (a step's event): a host that seldom waits is what bounds
    # the step; one that waits most of the step leaves the device busy.
    synced: dict[str, float] = {"unconstrained": 0.0, "json_schema": 0.0}
    wall: dict[str, float] = {"unconstrained": 0.0, "json_schema": 0.0}
    current = ["unconstrained"]
    if device.type == "cuda":
        event_sync = torch.cuda.Event.synchronize

        def timed_sync(self):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            event_sync(self)
            synced[current[0]] += time.perf_counter() - t

        torch.cuda.Event.synchronize = timed_sync
    # The matcher process's own account of its steps (see RemoteGrammarRows.child_stats).
    stats = getattr(runner.grammar, "child_stats", None) if runner is not None else None
    before = stats.clone() if stats is not None else None
    for _ in range(args.repeats):
        for name, params in (("unconstrained", free), ("json_schema", constrained)):
            current[0] = name
            seconds, outs = _timed(llm, prompts, params)
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            tokens[name] = n
            rows[name].append(n / seconds)
            wall[name] += seconds
            if name == "json_schema":
                check = outs
    child = None
    if stats is not None:
        child = stats - before
        child[2] = stats[2]
    if device.type == "cuda":
        torch.cuda.Event.synchronize = event_sync
    _, queries, hits = manager.take_stats()
    profiles = (
        {
            k: _profile(llm, prompts, v, args.profile)
            for k, v in (("unconstrained", free), ("json_schema", constrained))
        }
        if args.profile
        else None
    )

    # Every constrained token was allowed by the grammar at its position.
    compiled = manager.compiled(StructuredOutputsParams(json=SCHEMA))
    accepted_all = True
    lengths = []
    for out in check or []:
        matcher = compiled.new_matcher()
        ids = out.outputs[0].token_ids
        lengths.append(len(ids))
        accepted_all &= matcher.accept_tokens(ids)
    llm.engine.shutdown()

    best = {k: max(v) for k, v in rows.items()}
    ratio = best["json_schema"] / best["unconstrained"]
    steps = len(mask_s)
    report = {
        "benchmark": "structured_output",
        "command": "python benchmarks/structured_output.py "
        + " ".join(
            f"--{k.replace('_', '-')} {_relative(v)}".removesuffix(" True")
            for k, v in vars(args).items()
            if v not in (None, False)
        ),
        "model_config": Path(args.config).name,
        "bitmask": "filled on the host's path" if args.sync_mask else "prefetched in background",
        "matchers": "in the engine's process"
        if runner is None or hasattr(runner.grammar, "_prefetch_rows")
        else "in a process of their own, the device waiting for them"
        if runner.grammar._device_wait
        else "in a process of their own, the host waiting for them",
        "weights": weights,
        "batch": args.batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "hardware": hardware(device),
        "commit": commit(),
        "output_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in rows.items()},
        "best_output_tokens_per_s": {k: round(v, 1) for k, v in best.items()},
        "ratio_constrained_over_unconstrained": round(ratio, 4),
        "output_tokens": tokens,
        "constrained_output_lengths": {"min": min(lengths), "max": max(lengths)},
        "every_constrained_token_allowed": bool(accepted_all),
        "grammar_compile_s": [round(s, 4) for s in compile_times],
        "first_constrained_request_s": round(first_request_s, 3),
        "grammar_cache": {"queries": queries, "hits": hits},
        "grammar_thread_ms_per_step": {
            "wait_for_sampled_ids": _ms([w for w, _ in thread_s]),
            "advance_and_fill": _ms([f for _, f in thread_s]),
            "runner_waits_for_it": _ms(join_s),
        },
        "bitmask_host_ms_per_step": {
            "mean": round(1e3 * float(np.mean(mask_s)), 3) if steps else None,
            "p90": round(1e3 * float(np.percentile(mask_s, 90)), 3) if steps else None,
            "steps": steps,
        },
    }
    if child is not None and child[0] > 0:
        steps = float(child[0])
        report["matcher_process_ms_per_step"] = {
            "steps": int(steps),
            "advance_and_fill_mean": round(1e3 * float(child[1]) / steps, 3),
            "advance_and_fill_max_all_runs": round(1e3 * float(child[2]), 3),
            "wait_for_ids_mean": round(1e3 * float(child[3]) / steps, 3),
        }
    if device.type == "cuda":
        report["host_waits_for_device_share"] = {
            k: round(synced[k] / wall[k], 3) for k in synced if wall[k]
        }
    if profiles:
        report["profile"] = profiles
    name = f"structured-output-{Path(args.config).name}-b{args.batch}"
    save_report(
        report, f"{name}-{report['hardware'].split()[-1].lower()}-{commit()}", args.output_json
    )
    print(f"{'run':<16}{'best tok/s':>12}")
    for k, v in best.items():
        print(f"{k:<16}{v:>12.1f}")
    print(
        f"ratio {ratio:.3f}; compile {compile_times}; cache {hits}/{queries} hits; "
        f"mask {report['bitmask_host_ms_per_step']}; all allowed {accepted_all}; "
        f"grammar thread {report['grammar_thread_ms_per_step']}; host waits for the device "
        f"{report.get('host_waits_for_device_share')}; matcher process "
        f"{report.get('matcher_process_ms_per_step')}"
    )


if __name__ == "__main__":
    main()
