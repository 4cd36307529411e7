"""Pagoda's decode step against its memory-bandwidth floor.

A decode step must read every weight it multiplies by (all of them but the input embedding table,
of which it gathers a row per request) and the keys and values of every request's whole context.
Its floor is those bytes over the device's measured copy bandwidth::

    floor = (weight bytes + sum of context lengths x KV bytes per token) / copy bandwidth

The step time is the median interval between consecutive ends of steps in which every request
decodes one token and the batch is exactly B, from an ``on_step_end`` plugin: with the engine
overlapping one step's CPU work with the previous step's GPU work, the interval between step ends
is the step's real cost, where one step's own wall time is not.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.plugins import PLUGIN_API_VERSION, hookimpl

STEADY_STATE_DROP = 3  # intervals dropped at the start of a run of decode steps


@dataclass(slots=True)
class Step:
    end: float  # time.perf_counter() when the step's results were in
    reqs: int
    tokens: int  # scheduled tokens; equal to reqs when every request decodes one
    context: int  # sum over requests of the tokens attention reads (computed + scheduled)


class StepRecorder:
    """A plugin that keeps, for every engine step, when it ended and what it computed."""

    PAGODA_PLUGIN_API = PLUGIN_API_VERSION

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.start: float | None = None  # when the timed run began, if marked

    def mark_start(self) -> None:
        self.start = time.perf_counter()

    @hookimpl
    def on_step_end(self, scheduler_output: Any) -> None:
        so = scheduler_output
        context = so.total_num_scheduled_tokens
        for r in so.scheduled_new_reqs:
            context += r.num_computed_tokens
        for r in so.scheduled_cached_reqs:
            context += r.num_computed_tokens
        self.steps.append(
            Step(
                time.perf_counter(),
                len(so.num_scheduled_tokens),
                so.total_num_scheduled_tokens,
                context,
            )
        )


def decode_weight_bytes(hf_dir: str | Path, itemsize: int) -> int:
    """Bytes of the weights one decode step reads, at ``itemsize`` bytes a value: every tensor of
    the model's safetensors, less the input embedding table when the model has an lm_head of its
    own (tied weights are read once, as the lm_head)."""
    # NOTE: safetensors loads only where weights are read.
    from safetensors import safe_open

    # NOTE: torch and the engine load when a benchmark runs, not when the CLI builds its parser.
    from pagoda.loader import safetensors_files

    sizes: dict[str, int] = {}
    for path in safetensors_files(Path(hf_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                n = 1
                for dim in f.get_slice(name).get_shape():
                    n *= dim
                sizes[name] = n
    untied = any(name.endswith("lm_head.weight") for name in sizes)
    total = sum(
        n for name, n in sizes.items() if not (untied and name.endswith("embed_tokens.weight"))
    )
    return total * itemsize


def decode_floor_s(
    weight_bytes: int, context_tokens: int, kv_per_token: int, bandwidth: float
) -> float:
    """The least time a decode step can take: what it must read over the copy bandwidth."""
    return (weight_bytes + context_tokens * kv_per_token) / bandwidth


def decode_intervals(
    steps: list[Step], batch: int, drop: int = STEADY_STATE_DROP
) -> list[tuple[float, int]]:
    """(seconds, context tokens) of each step in which all of exactly ``batch`` requests decode,
    timed from the end of the step before (which must be one too); the first ``drop`` left out."""
    out = []
    for prev, cur in zip(steps, steps[1:]):
        if prev.reqs == prev.tokens == batch and cur.reqs == cur.tokens == batch:
            out.append((cur.end - prev.end, cur.context))
    return out[drop:]


def decode_row(
    steps: list[Step], batch: int, weight_bytes: int, kv_per_token: int, bandwidth: float
) -> dict[str, Any]:
    """The decode step at ``batch`` against its floor, over the steps of ``steps``."""
    iv = decode_intervals(steps, batch)
    if not iv:
        return {"batch": batch, "steps": 0, "note": f"no steady steps decoding exactly {batch}"}
    times = [t for t, _ in iv]
    floors = [decode_floor_s(weight_bytes, c, kv_per_token, bandwidth) for _, c in iv]
    contexts = [c for _, c in iv]
    return {
        "batch": batch,
        "steps": len(iv),
        "mean_context": round(statistics.fmean(contexts) / batch, 1),
        "kv_bytes_read": int(statistics.median(contexts) * kv_per_token),
        "step_ms": _sig(statistics.median(times) * 1e3),
        "floor_ms": _sig(statistics.median(floors) * 1e3),
        "step_over_floor": _sig(statistics.median(t / f for t, f in zip(times, floors))),
    }


def run_breakdown(
    steps: list[Step],
    weight_bytes: int,
    kv_per_token: int,
    bandwidth: float,
    start: float | None = None,
) -> dict[str, Any]:
    """Where a whole run's time went: the interval before each step's end charged to that step
    (the first step after ``start`` from ``start``), split into steps that prefill (any request
    scheduled more than one token), steps where every request decodes one, and steps that
    scheduled nothing; the decode steps' time against the sum of their floors, in all and by
    batch size (a quarter of the largest batch at a time, the smallest batches apart)."""
    if start is not None:
        steps = [Step(start, 0, 0, 0)] + [s for s in steps if s.end > start]
    biggest = max((s.reqs for s in steps), default=1)
    cuts = (biggest + 1, 3 * biggest // 4, biggest // 2, biggest // 4, biggest // 16, 1)
    edges = sorted({max(1, c) for c in cuts})
    # Each bucket: its batch sizes, the intervals of its steps, the sum of their floors.
    buckets = [[lo, hi - 1, [], 0.0] for lo, hi in zip(edges, edges[1:]) if lo < hi]
    pre_s = idle_s = 0.0
    pre_n = pre_tokens = idle_n = 0
    for prev, cur in zip(steps, steps[1:]):
        dt = cur.end - prev.end
        if cur.reqs == 0:  # a step that scheduled nothing (the engine waited on its queue)
            idle_s += dt
            idle_n += 1
            continue
        if cur.tokens > cur.reqs:
            pre_s += dt
            pre_n += 1
            pre_tokens += cur.tokens
            continue
        b = next(b for b in buckets if b[0] <= cur.reqs <= b[1])
        b[2].append(dt)
        b[3] += decode_floor_s(weight_bytes, cur.context, kv_per_token, bandwidth)
    dec_s = sum(sum(b[2]) for b in buckets)
    dec_floor_s = sum(b[3] for b in buckets)
    return {
        "prefill_steps": pre_n,
        "prefill_s": round(pre_s, 3),
        "prefill_scheduled_tokens": pre_tokens,
        "empty_steps": idle_n,
        "empty_s": round(idle_s, 3),
        "decode_steps": sum(len(b[2]) for b in buckets),
        "decode_s": round(dec_s, 3),
        "decode_floor_s": round(dec_floor_s, 3),
        "decode_over_floor": _sig(dec_s / dec_floor_s) if dec_floor_s else None,
        "decode_by_batch": [
            {
                "batch_from": lo,
                "batch_to": hi,
                "steps": len(dts),
                "s": round(sum(dts), 3),
                "floor_s": round(f, 3),
                "step_ms": _sig(sum(dts) / len(dts) * 1e3) if dts else None,
                "over_floor": _sig(sum(dts) / f) if f else None,
                **_stalls(dts),
            }
            for lo, hi, dts, f in reversed(buckets)
        ],
    }


def _stalls(dts: list[float]) -> dict[str, Any]:
    """The median step, and the steps over 1.5 times it (a compile, a collection, a host that
    fell behind the device) with the time they took beyond the median: what sets two runs of one
    commit apart."""
    if not dts:
        return {"median_step_ms": None, "slow_steps": 0, "slow_excess_s": 0.0}
    med = statistics.median(dts)
    slow = [d for d in dts if d > 1.5 * med]
    return {
        "median_step_ms": _sig(med * 1e3),
        "slow_steps": len(slow),
        "slow_excess_s": round(sum(d - med for d in slow), 3),
    }


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def run_roofline(
    llm: Any,
    recorder: StepRecorder,
    batches: tuple[int, ...],
    input_len: int,
    steps: int,
    prompt_source: Any,
    floor_args: tuple[int, int, float],
) -> list[dict[str, Any]]:
    """Decode ``steps`` steady steps at each batch size on ``llm`` (whose engine ``recorder``
    observes); ``prompt_source(n, length, seed)`` gives the prompts, ``floor_args`` is
    (weight bytes, KV bytes per token, copy bandwidth)."""
    # NOTE: torch and the engine load when a benchmark runs, not when the CLI builds its parser.
    from pagoda import SamplingParams

    info = llm.engine.info
    max_seqs = llm.config.scheduler.max_num_seqs
    rows = []
    for b in batches:
        if b > max_seqs:
            rows.append({"batch": b, "steps": 0, "note": f"above max_num_seqs={max_seqs}"})
            continue
        # Requests prefilled first decode while the others prefill: they need the headroom to
        # still be running once the whole batch decodes.
        prefill_steps = -(-b * input_len // info.max_num_batched_tokens)
        new = steps + STEADY_STATE_DROP + prefill_steps + 2
        length = min(input_len, info.max_model_len - new)
        if length < 1:
            rows.append({"batch": b, "steps": 0, "note": "max_model_len too small"})
            continue
        prompts = prompt_source(b, length, b)
        recorder.steps.clear()
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        rows.append({**decode_row(recorder.steps, b, *floor_args), "input_len": length})
    return rows
