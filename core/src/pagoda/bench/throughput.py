"""``pagoda bench throughput``: offline generation speed, Pagoda and transformers in one run.

Every engine gets the same random token-id prompts and the same weights, and generates exactly
each request's own number of greedy tokens (EOS ignored), so the work is identical; the figure is
output tokens per second of generation, loading excluded. Peers are transformers' continuous
batching and its static-cache ``generate`` (:mod:`pagoda.bench.peers`); a slow peer may run the
first N requests only, and is then compared by its rate. With ``--roofline``, Pagoda's decode step
is set against its memory-bandwidth floor (:mod:`pagoda.bench.roofline`). Workload presets:
:mod:`pagoda.bench.workloads`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from pagoda.bench import peers, roofline
from pagoda.bench.report import commit, hardware, save_report, slug, throughput_figures, versions
from pagoda.bench.workloads import PRESETS, Workload


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        choices=sorted(PRESETS),
        default=None,
        help="a preset (model, counts, lengths); options given here override it",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="requests (default 64)")
    p.add_argument("--min-input-len", type=int, default=None, help="default 32")
    p.add_argument("--max-input-len", type=int, default=None, help="default 512")
    p.add_argument("--output-len", type=int, default=None, help="fixed output length (128)")
    p.add_argument("--min-output-len", type=int, default=None, help="output lengths uniform in")
    p.add_argument("--max-output-len", type=int, default=None, help="[min, max] per request")
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument(
        "--random-weights",
        metavar="CONFIG_DIR",
        default=None,
        help="a folder with a config.json: every engine runs it on random weights, built once "
        "into Pagoda's cache (presets do this with benchmarks/configs unless --model is given)",
    )
    p.add_argument("--weights-seed", type=int, default=0)
    p.add_argument(
        "--peers",
        choices=("all", "none", "cb", "static"),
        default=None,
        help="transformers engines to run too: continuous batching, static-cache generate "
        "(default: all; none for the nano workload)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature of every request (default 0, greedy; 0.6 for nano)",
    )
    p.add_argument("--skip-hf", action="store_true", help="measure Pagoda only (--peers none)")
    p.add_argument(
        "--peer-num-prompts",
        type=int,
        default=None,
        help="peers run only the first N requests (reported as reduced; compare rates)",
    )
    p.add_argument(
        "--static-batch-size",
        "--hf-batch-size",
        dest="static_batch_size",
        type=int,
        default=None,
        help="batch size of static-cache generate (default: all requests in one batch)",
    )
    p.add_argument(
        "--roofline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode step time at --roofline-batches against its bandwidth floor (default: on "
        "for the Llama-3.1-8B presets on a GPU)",
    )
    p.add_argument("--roofline-batches", type=_int_list, default=None, help="default 1,64,256")
    p.add_argument("--roofline-input-len", type=int, default=None, help="prompt length (512)")
    p.add_argument("--roofline-steps", type=int, default=None, help="steady steps timed (32)")
    p.add_argument(
        "--output-json",
        default=None,
        help="where to write results (default: benchmarks/results/throughput-*.json "
        "under the current directory)",
    )


def run_throughput(args: argparse.Namespace, config: Any) -> int:
    """Run the benchmark of ``args`` with the engine configuration ``config``."""
    # NOTE: torch and the engine load when a benchmark runs, not when the CLI builds its parser.
    from pagoda.bench.prepare import prepare

    load_start = os.getloadavg()  # a shared machine's other work slows every engine
    run = prepare(args, config)
    wl, info, device = run.workload, run.info, run.info.device
    pagoda, startup, decode, table, breakdown = _pagoda_phase(run)
    peers.release(device)
    results: dict[str, Any] = {"pagoda": pagoda}
    n_peer = min(wl.peer_num_prompts or wl.num_prompts, wl.num_prompts)
    for name in run.peers:
        _say(f"transformers_{name} on {n_peer} requests")
        results[f"transformers_{name}"] = _run_peer(name, run, n_peer)
    for name in run.peers:
        r = results[f"transformers_{name}"]
        if "output_tokens_per_s" in r:
            ratio = pagoda["output_tokens_per_s"] / r["output_tokens_per_s"]
            results[f"pagoda_over_transformers_{name}"] = round(ratio, 3)
    gpu = hardware(device) if device.type == "cuda" else None
    report = {
        "benchmark": "throughput",
        "workload": {**wl.describe(), "input_tokens": sum(map(len, run.prompts))},
        "model": run.model_label,
        "weights": run.weights,
        "dtype": str(info.dtype).replace("torch.", ""),
        "device": device.type,
        "gpu": gpu,
        "hardware": hardware(device),
        "commit": commit(),
        **versions(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "engine_config": run.config.model_dump(mode="json", exclude={"server"}),
        "startup": startup,
        "results": results,
        "decode_at_full_batch": decode,
        "run_breakdown": breakdown,
        "roofline": None,
    }
    if table is not None:
        report["roofline"] = {
            "copy_bandwidth_GBps": round(run.bandwidth / 1e9, 1),
            "weight_bytes": run.weight_bytes,
            "kv_bytes_per_token": run.kv_per_token,
            "rows": table,
        }
    where = slug(gpu) if gpu else "cpu"
    name = f"throughput-{wl.name}-{slug(run.model_label)}-{where}-{report['commit']}"
    path = save_report(report, name, args.output_json)
    _print_summary(report, wl)
    print(f"results: {path}")
    return 0


def _pagoda_phase(run: Any) -> tuple[dict[str, Any], dict[str, Any], Any, Any, Any]:
    """Pagoda on the workload, its decode step at the workload's full batch, the run's prefill
    and decode shares, and the roofline table on the same engine; the engine is shut down at the
    end."""
    # NOTE: torch and the engine load when a benchmark runs, not when the CLI builds its parser.
    from pagoda.plugins import plugin_registered

    wl = run.workload
    floor_args = None
    if run.weight_bytes is not None:
        floor_args = (run.weight_bytes, run.kv_per_token, run.bandwidth)
    recorder = roofline.StepRecorder()
    decode = table = breakdown = None
    # NOTE: registered before the engine is built: the engine core binds its seams then.
    with plugin_registered(recorder, "pagoda-bench-steps"):
        _say(f"pagoda on {wl.num_prompts} requests")
        pagoda, startup, llm = _run_pagoda(
            run.config, run.prompts, run.out_lens, wl.temperature, on_start=recorder.mark_start
        )
        try:
            if floor_args is not None:
                batch = min(wl.num_prompts, run.config.scheduler.max_num_seqs)
                decode = roofline.decode_row(recorder.steps, batch, *floor_args)
                breakdown = roofline.run_breakdown(
                    recorder.steps, *floor_args, start=recorder.start
                )
            if run.roofline and floor_args is not None:
                _say(f"roofline at batch {', '.join(map(str, wl.roofline_batches))}")
                table = roofline.run_roofline(
                    llm,
                    recorder,
                    wl.roofline_batches,
                    wl.roofline_input_len,
                    wl.roofline_steps,
                    run.prompt_source,
                    floor_args,
                )
        finally:
            llm.engine.shutdown()
    return pagoda, startup, decode, table, breakdown


def _run_pagoda(
    config: Any,
    prompts: list[list[int]],
    out_lens: list[int],
    temperature: float = 0.0,
    on_start: Callable[[], None] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    # NOTE: torch and the engine load when a benchmark runs, not when the CLI builds its parser.
    from pagoda import LLM, SamplingParams
    from pagoda.process import tuned_gc

    t0 = time.perf_counter()
    llm = LLM(config=config)
    load_s = time.perf_counter() - t0
    # NOTE: the parts exist where the engine core times its start-up; the total always does.
    parts = getattr(llm.engine.engine_core, "startup_times", None) or {}
    startup = {"engine_s": round(load_s, 3), **{k: round(v, 3) for k, v in parts.items()}}
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], warm, use_tqdm=False)
    params = [
        SamplingParams(max_tokens=o, temperature=temperature, ignore_eos=True) for o in out_lens
    ]
    # NOTE: the collector tuned as in the engine-core process that serves (pagoda.process)
    with tuned_gc():
        if on_start is not None:
            on_start()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    lens = [len(o.outputs[0].token_ids) for o in outs]
    figures = throughput_figures(elapsed, sum(map(len, prompts)), sum(lens), load_s)
    figures.update(num_prompts=len(prompts), reduced=False, exact_output_lengths=lens == out_lens)
    figures["gc_tuned"] = True
    spec = getattr(getattr(llm.engine.engine_core, "scheduler", None), "spec_stats_total", None)
    if spec is not None and spec.num_drafts:
        figures["speculative"] = {
            "acceptance_rate": round(spec.acceptance_rate, 4),
            "mean_acceptance_length": round(spec.mean_acceptance_length, 3),
            "drafts": spec.num_drafts,
            "draft_tokens": spec.num_draft_tokens,
            "accepted_tokens": spec.num_accepted_tokens,
            # How often the draft at each position was accepted, per draft: how deep drafts pay.
            "acceptance_per_position": [
                round(a / spec.num_drafts, 4) for a in spec.accepted_per_pos
            ],
        }
    return figures, startup, llm


def _run_peer(name: str, run: Any, n: int) -> dict[str, Any]:
    """One transformers engine on the first ``n`` requests; an error is recorded, not raised."""
    info = run.info
    prompts, out_lens = run.prompts[:n], run.out_lens[:n]
    try:
        if name == "cb":
            out = peers.run_cb(info.hf_dir, info.dtype, info.device, prompts, out_lens)
        else:
            batch = run.workload.static_batch_size or n
            out = peers.run_static(
                info.hf_dir, info.dtype, info.device, prompts, out_lens, run.pad_id, batch
            )
    except Exception as e:  # a peer that fails leaves the others' figures standing
        out = {"error": f"{type(e).__name__}: {e}"}
        peers.release(info.device)
    return {**out, "num_prompts": n, "reduced": n < len(run.prompts)}


def _say(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] bench throughput: {what}", file=sys.stderr, flush=True)


def _print_summary(report: dict[str, Any], wl: Workload) -> None:
    res = report["results"]
    print(
        f"workload {wl.name}: {wl.num_prompts} requests, input {wl.input_len}, output "
        f"{wl.output_len}; {report['model']} ({report['dtype']}) on {report['hardware']}"
    )
    print(f"{'engine':<22}{'requests':>9}{'output tok/s':>14}{'total tok/s':>13}{'pagoda/x':>10}")
    for name, r in res.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            print(f"{name:<22}{r['num_prompts']:>9}  failed: {r['error'][:60]}")
            continue
        ratio = res.get(f"pagoda_over_{name}")
        n = f"{r['num_prompts']}{'*' if r['reduced'] else ''}"
        print(
            f"{name:<22}{n:>9}{r['output_tokens_per_s']:>14.1f}{r['total_tokens_per_s']:>13.1f}"
            f"{'' if ratio is None else f'{ratio:.2f}':>10}"
        )
    if any(isinstance(r, dict) and r.get("reduced") for r in res.values()):
        print("* reduced workload (the first requests only): compare rates, not times")
    d = report["decode_at_full_batch"]
    if d and d.get("steps"):
        print(
            f"decode at batch {d['batch']} in the workload: {d['step_ms']:.2f} ms a step, floor "
            f"{d['floor_ms']:.2f} ms, {d['step_over_floor']:.2f}x"
        )
    b = report.get("run_breakdown")
    if b:
        print(
            f"the run: {b['prefill_steps']} steps with prefill took {b['prefill_s']:.2f} s, "
            f"{b['decode_steps']} decode steps {b['decode_s']:.2f} s "
            f"({b['decode_over_floor']}x their floors)"
        )
        for r in b["decode_by_batch"]:
            if r["steps"]:
                print(
                    f"  decode at batch {r['batch_from']}-{r['batch_to']}: {r['steps']} steps, "
                    f"{r['s']:.2f} s, {r['step_ms']} ms a step, {r['over_floor']}x the floor"
                    f" (median {r['median_step_ms']} ms; {r['slow_steps']} steps over 1.5x it,"
                    f" {r['slow_excess_s']:.3f} s beyond it)"
                )
    if report["roofline"]:
        rl = report["roofline"]
        print(f"roofline, copy bandwidth {rl['copy_bandwidth_GBps']:.0f} GB/s:")
        print(f"{'batch':>7}{'context':>9}{'step ms':>10}{'floor ms':>10}{'step/floor':>12}")
        for row in rl["rows"]:
            if not row["steps"]:
                print(f"{row['batch']:>7}  {row['note']}")
                continue
            print(
                f"{row['batch']:>7}{row['mean_context']:>9.0f}{row['step_ms']:>10.2f}"
                f"{row['floor_ms']:>10.2f}{row['step_over_floor']:>12.2f}"
            )
    parts = ", ".join(f"{k} {v}" for k, v in report["startup"].items() if k != "engine_s")
    print(f"start-up: {report['startup']['engine_s']:.1f} s" + (f" ({parts})" if parts else ""))
