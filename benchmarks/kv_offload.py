"""KV offload to CPU memory: time to first token and throughput of a multi-turn chat workload
whose shared prefixes are several times the device's KV cache, offload on against off.

Each of ``--conversations`` conversations opens with its own long context (``--prefix-len``
random tokens: a document, a system prompt, a code base) and goes on for ``--turns`` turns:
every turn's prompt is the context, the turns before with their answers, and a new question.
Conversations take turns round-robin, ``--concurrency`` requests at a time, so by the time a
conversation comes back the device has evicted its context: without offload it is computed
again, with offload it is loaded from the CPU pool. Random weights (``--random-weights``) are
enough: the work does not depend on them. Both engines run in this process, one after the
other, on the same prompts and the same attention backend; after each, the pools' figures
once idle are recorded, then again after ``reset_prefix_cache``. With offload on, the report
also gives the bus's figures: the blocks copied each way and the device time their copies took,
and one plain host-to-device copy of a context's bytes out of the pinned pool (the floor of a
load). With ``--overlap`` the offloading engine then plays the workload once more, from empty
pools, with ``cache.offload_overlap`` on (a long hit computed from its start while its end
loads): the ``overlap`` figures.

Idle means: no request holds a device block (every usable block free, though cached ones keep
their contents for later prefix hits), no CPU slot pinned by a load or being stored, no copy
job in flight, no request waiting for a load. The CPU pool's cached blocks stay: they are the
contents the pool exists to keep (``cpu_blocks_cached``), evicted by its policy when new blocks
need room, and dropped by ``reset_prefix_cache`` (``after_reset``: zero).

    python benchmarks/kv_offload.py /tmp/out --random-weights benchmarks/configs/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.report import commit, hardware, save_report
from pagoda.kv_offload import OffloadStats
from pagoda.kv_offload.sizing import block_bytes_per_rank

_WORKLOAD_KEYS = (
    "conversations", "turns", "prefix_len", "question_len", "answer_len", "concurrency",
    "cpu_offload_gb", "offload_policy", "offload_store", "dtype",
)  # fmt: skip


def conversations(n: int, prefix_len: int, question_len: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, vocab - 10) for _ in range(prefix_len)] for _ in range(n)]


def run(llm: LLM, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Play the workload on ``llm``: every request's time to first token, and the totals."""
    engine = llm.engine
    rng = random.Random(1)
    history = conversations(args.conversations, args.prefix_len, args.question_len, vocab)
    params = SamplingParams(max_tokens=args.answer_len, temperature=0.0, ignore_eos=True)
    order = [(t, c) for t in range(args.turns) for c in range(args.conversations)]
    ttft: list[float] = []
    first_turn_ttft: list[float] = []
    # Later turns: from the request's arrival until its context (the prompt but for the turn's
    # question) counts as computed, loaded or not; and from then to its first token.
    context_ms: list[float] = []
    rest_ms: list[float] = []
    context_at: dict[str, float] = {}
    requests = engine.engine_core.scheduler.requests
    in_flight: dict[str, tuple[int, int, float, bool]] = {}  # id -> conv, turn, start, got 1st
    busy: set[int] = set()
    answers: dict[int, list[list[int]]] = {c: [] for c in range(args.conversations)}
    prompt_tokens = output_tokens = 0
    start = time.perf_counter()
    i = 0
    while i < len(order) or in_flight:
        while i < len(order) and len(in_flight) < args.concurrency and order[i][1] not in busy:
            turn, conv = order[i]
            question = [rng.randrange(10, vocab - 10) for _ in range(args.question_len)]
            history[conv] = history[conv] + question
            rid = f"c{conv}t{turn}"
            engine.add_request(rid, {"prompt_token_ids": list(history[conv])}, params)
            prompt_tokens += len(history[conv])
            in_flight[rid] = (conv, turn, time.perf_counter(), False)
            busy.add(conv)
            i += 1
        outs = engine.step()
        now = time.perf_counter()
        for rid, (_, turn, _, _) in in_flight.items():
            req = requests.get(rid)
            if turn and rid not in context_at and req is not None:
                if req.num_computed_tokens >= req.num_prompt_tokens - args.question_len:
                    context_at[rid] = now
        for out in outs:
            conv, turn, t0, seen = in_flight[out.request_id]
            tokens = out.outputs[0].token_ids
            if tokens and not seen:
                (first_turn_ttft if turn == 0 else ttft).append(now - t0)
                in_flight[out.request_id] = (conv, turn, t0, True)
                if out.request_id in context_at:
                    context_ms.append(1000 * (context_at[out.request_id] - t0))
                    rest_ms.append(1000 * (now - context_at[out.request_id]))
            if out.finished:
                history[conv] = history[conv] + list(tokens)
                answers[conv].append(list(tokens))
                output_tokens += len(tokens)
                busy.discard(conv)
                del in_flight[out.request_id]
    elapsed = time.perf_counter() - start
    all_ttft = first_turn_ttft + ttft
    return {
        "requests": len(order),
        "elapsed_s": round(elapsed, 3),
        "ttft_p50_ms": round(1000 * float(np.median(all_ttft)), 2),
        "ttft_p90_ms": round(1000 * float(np.percentile(all_ttft, 90)), 2),
        "ttft_p50_later_turns_ms": round(1000 * float(np.median(ttft)), 2) if ttft else None,
        "ttft_p50_first_turn_ms": round(1000 * float(np.median(first_turn_ttft)), 2),
        "later_turns_context_p50_ms": _median(context_ms),
        "later_turns_rest_p50_ms": _median(rest_ms),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / elapsed, 1),
        "answers": answers,
    }


def _median(ms: list[float]) -> float | None:
    return round(float(np.median(ms)), 2) if ms else None


def pool_figures(llm: LLM) -> dict[str, Any]:
    """The device and CPU pools' figures (call it once no request runs)."""
    core = llm.engine.engine_core
    kv = core.kv_cache_manager
    out: dict[str, Any] = {
        "gpu_blocks": kv.num_blocks - 1,
        "gpu_free_blocks": kv.num_free_blocks,
        "gpu_blocks_held": kv.num_blocks - 1 - kv.num_free_blocks,
        "requests_holding_blocks": len(kv.req_to_blocks),
    }
    off = core.scheduler.offload
    if off is not None:
        stats = off.stats_total
        out.update(
            cpu_blocks=off.num_cpu_blocks,
            cpu_blocks_cached=off.num_used,
            stored_blocks=stats.stored_blocks,
            loaded_blocks=stats.loaded_blocks,
            cpu_hit_tokens=stats.cpu_hit_tokens,
            **off.idle_figures(),
            copies_in_flight=_medium(llm).num_in_flight,
        )
        if off.overlap:  # the share of a hit computed rather than loaded, as learned
            out["overlap_share"] = round(off.overlap_share, 3)
    return out


def _runner(llm: LLM) -> Any:
    return llm.engine.engine_core.executor.worker.model_runner


def _medium(llm: LLM) -> Any:
    return _runner(llm).kv_offload


def bus_figures(llm: LLM, context_tokens: int) -> dict[str, Any]:
    """What the copies of the run moved and how fast, and one plain host-to-device copy of a
    context's blocks out of the pinned pool: the fastest a load of that context can be."""
    medium = _medium(llm)
    c = medium.copied
    gb = medium.block_bytes / 1e9
    out: dict[str, Any] = {
        "block_bytes": medium.block_bytes,
        "layers_in_one_view": medium.stacked is not None,
        "loaded_blocks": c["load_blocks"],
        "load_device_s": round(c["load_s"], 4),
        "load_GBps": round(c["load_blocks"] * gb / c["load_s"], 1) if c["load_s"] else None,
        "stored_blocks": c["store_blocks"],
        "store_device_s": round(c["store_s"], 4),
        "store_GBps": round(c["store_blocks"] * gb / c["store_s"], 1) if c["store_s"] else None,
    }
    if not medium.cuda:
        return out
    block_size = llm.engine.engine_core.kv_cache_manager.block_size
    n = min(medium.num_blocks, -(-context_tokens // block_size))
    src = medium.cpu[:n]
    dst = torch.empty(src.shape, dtype=src.dtype, device=medium.device)
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    best = min(times)
    out.update(
        plain_copy_blocks=n,
        plain_copy_ms=round(1000 * best, 2),
        plain_copy_GBps=round(n * gb / best, 1),
    )
    del dst
    return out


def measure(llm: LLM, args: argparse.Namespace, vocab: int, max_len: int) -> dict[str, Any]:
    """One pass of the workload from empty pools (after a warm-up request), then the pools'
    figures once idle, and again after ``reset_prefix_cache``; the bus's with offload."""
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    warm_ids = [10 + i % (vocab - 20) for i in range(min(1000, max_len - 8))]
    llm.generate([{"prompt_token_ids": warm_ids}], warm, use_tqdm=False)
    kv = llm.engine.engine_core.kv_cache_manager
    kv.reset_prefix_cache()
    figures = run(llm, args, vocab)
    figures["idle_pools"] = pool_figures(llm)
    if kv.offload is not None:
        figures["bus"] = bus_figures(llm, args.prefix_len)
    kv.reset_prefix_cache()
    figures["idle_pools"]["after_reset"] = {
        k: v
        for k, v in pool_figures(llm).items()
        if k in ("gpu_free_blocks", "gpu_blocks_held", "cpu_blocks_cached")
    }
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output_dir", help="folder for the JSON report")
    ap.add_argument("--random-weights", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=16384)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--answer-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument(
        "--prefix-to-cache", type=float, default=4.0,
        help="the conversations' contexts over the device KV cache",
    )  # fmt: skip
    ap.add_argument("--cpu-offload-gb", type=float, default=8.0)
    ap.add_argument("--offload-policy", default="lru")
    ap.add_argument(
        "--offload-store", default="full", choices=["evicted", "full"],
        help="full: store blocks as they are computed, so that a load never waits for the"
        " stores of the blocks it evicts",
    )  # fmt: skip
    ap.add_argument(
        "--overlap", action="store_true",
        help="a third pass with cache.offload_overlap (the offloading engine, run again)",
    )  # fmt: skip
    ap.add_argument(
        "--saved-weights", action="store_true",
        help="random weights built once and saved (pagoda.bench.random_weights) rather than drawn"
        " at each engine's load (load_format=dummy draws on the CPU: slow for an 8B model)",
    )  # fmt: skip
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    args = ap.parse_args()

    from pagoda.config import CacheConfig
    from pagoda.loader import load_hf_config
    from pagoda.models.native import NativeModelImpl

    shape = NativeModelImpl.shape(load_hf_config(args.random_weights), 1)
    dtype = getattr(torch, args.dtype)
    token_bytes = block_bytes_per_rank(CacheConfig(), shape, dtype) // CacheConfig().block_size
    cache_tokens = int(args.conversations * args.prefix_len / args.prefix_to_cache)
    max_len = args.prefix_len + args.turns * (args.question_len + args.answer_len) + 16
    cache_tokens = max(cache_tokens, max_len + 64)
    common = dict(
        model=args.random_weights,
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        max_model_len=max_len,
        kv_cache_memory_bytes=cache_tokens * token_bytes,
        max_num_seqs=max(8, args.concurrency),
    )
    weights: dict[str, Any] = {"load_format": "dummy"}
    if args.saved_weights:  # drawn once on the device and saved: dummy draws take long at 8B
        from pagoda.bench.random_weights import ensure_random_weights

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        folder, weights = ensure_random_weights(Path(args.random_weights), 0, device)
        common.update(model=str(folder), load_format="auto")
    report: dict[str, Any] = {
        "benchmark": "kv_offload",
        "commit": commit(),
        "workload": {k: getattr(args, k) for k in _WORKLOAD_KEYS},
        "model": Path(args.random_weights).name + " (random weights)",
        "weights": weights,
        "gpu_kv_cache_tokens": cache_tokens,
        "prefixes_over_kv_cache": round(args.conversations * args.prefix_len / cache_tokens, 2),
    }
    vocab = shape.vocab_size
    t_start = time.perf_counter()
    offload = {
        "cpu_offload_gb": args.cpu_offload_gb,
        "offload_policy": args.offload_policy,
        "offload_store": args.offload_store,
    }
    # The overlap pass reuses the offloading engine: pools emptied, counts reset, overlap on.
    engines = [("off", {}, ["off"]), ("on", offload, ["on"] + ["overlap"] * args.overlap)]
    for _, extra, passes in engines:
        t0 = time.perf_counter()
        llm = LLM(**common, **extra)
        load_s = time.perf_counter() - t0
        # NOTE: both engines on one backend, even if a background compile makes another ready.
        common["attention_backend"] = _runner(llm).attn_backend.name
        report["attention_backend"] = common["attention_backend"]
        report["hardware"] = hardware(llm.engine.info.device)
        for name in passes:
            if name == "overlap":
                off = llm.engine.engine_core.scheduler.offload
                off.overlap, off.stats_total = True, OffloadStats()
                _medium(llm).copied = dict.fromkeys(_medium(llm).copied, 0)
            figures = measure(llm, args, vocab, max_len)
            figures["load_s"] = round(load_s, 2)
            report[name] = figures
            print(
                f"offload {name}: TTFT p50 {figures['ttft_p50_ms']} ms (later turns "
                f"{figures['ttft_p50_later_turns_ms']} ms), {figures['total_tokens_per_s']}"
                f" tokens/s, {figures['elapsed_s']} s; idle pools"
                f" {json.dumps(figures['idle_pools'])}"
                f"{'; bus ' + json.dumps(figures['bus']) if 'bus' in figures else ''}"
                f" (+{time.perf_counter() - t_start:.0f} s)",
                flush=True,
            )
        llm.engine.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    want = report["off"].pop("answers")
    for name in ("on", "overlap"):
        if name not in report:
            continue
        figures = report[name]
        report[f"answers_equal_{name}"] = figures.pop("answers") == want
        report[f"ttft_p50_speedup_{name}"] = round(
            report["off"]["ttft_p50_ms"] / figures["ttft_p50_ms"], 2
        )
        report[f"throughput_ratio_{name}"] = round(
            figures["total_tokens_per_s"] / report["off"]["total_tokens_per_s"], 2
        )
        print(
            f"TTFT p50 cut ({name}) {report[f'ttft_p50_speedup_{name}']}x, throughput"
            f" {report[f'throughput_ratio_{name}']}x, answers equal:"
            f" {report[f'answers_equal_{name}']}"
        )
    name = f"kv-offload-{Path(args.random_weights).name}-{report['commit']}"
    path = save_report(report, name, str(Path(args.output_dir) / f"{name}.json"))
    print(f"wrote {path}")
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
