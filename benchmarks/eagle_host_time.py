"""Where a draft head's host time goes at batch 1: tokens/s without speculation and with a
random EAGLE-3 head (nothing accepted), governed and not, and the host seconds spent in the
speculation path's functions (wrapped timers, no profiler, so the steps keep their pace).

    python benchmarks/eagle_host_time.py [--model benchmarks/configs/smollm2-135m]
        [--variants none,gov,nogov] [--device cuda] [--rounds 3] [--output-json PATH]
        [--method eagle3|ngram|suffix]

``--method ngram`` or ``suffix``: the history proposers instead of the head, with only ``method``
set (``nogov``: and ``adaptive: false``). With ``--accept-all`` their drafts repeat token 0 as
the target does, so each verification emits its drafts' whole length: what a verifying step of
theirs costs against a plain one, phase by phase under ``--trace``, on random weights.

Variants: ``none`` (no speculation), ``gov`` (the head, governed), ``nogov`` (the head, drafting
whenever its own back-off lets it), ``off`` (the head loaded, drafting never: what its
bookkeeping costs plain steps), ``noahead`` (``nogov`` with no verification launched before
the step in flight is read: what ``pagoda.worker.drafts_ahead`` buys). The variants take turns,
``--rounds`` times over the prompts (a host that slows down for a while slows each alike); each
ratio to ``none`` is of the medians.

The model is a config folder (random weights, cached) or a checkpoint. A random head drafts
nothing that is accepted, so what it costs is the proposer's bookkeeping, its catch-up drafts
and the waits its verification steps add.

``--accept-all``: the other end, every draft accepted. The target's and the head's final norms
are zeroed, so both always pick token 0 (greedy ties go to the lowest id): each verification
emits k + 1 tokens, and the ratio to ``none`` is what a step with drafts costs against a plain
one, at the most a head can accept. ``--model benchmarks/configs/tiny-llama --device cpu`` makes
a step's compute small, so the timers show mostly the host's work.

``--profile`` (after the timed rounds): one prompt per variant under cProfile, the host's time a
step by function (own time and total), for finding what a verification step's host work is.

``--trace`` (after the timed rounds): one prompt per variant under the torch profiler, with the
time a step's kernels keep the device busy against the step's wall time. Where a step's wall time
is far above its busy time the device waits for the host (on the step's critical path: at batch
1 with draft slots a launch waits for the step before it); the profiler slows the host a little,
so the waiting it shows is an upper bound.
"""

import argparse
import collections
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pagoda_spec_eagle.chain as ec
import pagoda_spec_eagle.proposer as ep
import torch
from pagoda_spec_eagle.checkpoint import llama_head_config, random_head_weights, write_head
from pagoda_spec_ngram.proposer import NgramProposer
from pagoda_spec_suffix.proposer import SuffixProposer
from safetensors.torch import load_file, save_file

import pagoda.engine.llm_engine as le
import pagoda.engine.output_processor as op
import pagoda.worker.cuda_graph as cg
import pagoda.worker.greedy_verify_graphs as gvg
import pagoda.worker.hidden_states as hd
import pagoda.worker.model_runner as mr
import pagoda.worker.spec_propose as sp
import pagoda.worker.step_buffers as sb
import pagoda.worker.step_output as so_mod
import pagoda.worker.steps_in_flight as sif
from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.bench.report import commit, hardware, save_report
from pagoda.engine.core import EngineCore
from pagoda.models.llama import LlamaForCausalLM
from pagoda.process import tuned_gc
from pagoda.scheduler.scheduler import Scheduler

T = collections.defaultdict(float)
N = collections.Counter()
LABELS: set[str] = set()
TRACING = [False]  # under ``--trace``: each wrapped call is a profiler range too


def wrap(owner, name, label):
    f = getattr(owner, name)
    LABELS.add(label)

    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        rf = torch.profiler.record_function(label) if TRACING[0] else None
        if rf is not None:
            rf.__enter__()
        try:
            r = f(*a, **k)
            if label == "must_read_last" and r:
                N["must_read_true"] += 1
            return r
        finally:
            if rf is not None:
                rf.__exit__(None, None, None)
            T[label] += time.perf_counter() - t
            N[label] += 1

    setattr(owner, name, w)


# What is timed: (owner, function, label).
TIMED = (
    (sp, "propose", "verify.propose"),
    (mr, "must_read_last", "must_read_last"),
    (mr, "propose_for_slots", "propose_for_slots"),
    (mr, "fill_draft_slots", "fill_draft_slots"),
    (hd.HiddenFeed, "record", "hidden.record"),
    (hd.HiddenFeed, "hold", "hidden.hold"),
    (hd.HiddenFeed, "take", "hidden.take"),
    (ep.EagleProposer, "propose", "eagle.propose"),
    (ep.EagleProposer, "draft_after_verify", "eagle.draft_after_verify"),
    (mr.ModelRunner, "launch", "runner.launch"),
    (sif.StepsInFlight, "read_all", "runner.read_unread"),
    (so_mod.StepOutput, "get", "step.get"),
    (so_mod.StepOutput, "_build", "step._build"),
    (mr, "verify_drafts", "verify_drafts"),
    (ec.DenseChain, "load_verified", "chain.load_verified"),
    (ec.DenseChain, "run", "chain.run"),  # on a CPU: the head's compute
    (LlamaForCausalLM, "forward", "model.forward"),  # eager steps only: the target's compute
    (mr, "run_verify_graph", "run_verify_graph"),
    (NgramProposer, "propose", "ngram.propose"),
    (SuffixProposer, "propose", "suffix.propose"),
    (mr, "propose_after", "propose_after"),
    (Scheduler, "schedule", "scheduler.schedule"),
    (Scheduler, "update_from_output", "scheduler.update_from_output"),
    (EngineCore, "step", "engine.step"),
    # Finer: the runner's copies, graph replays and sampling, and the engine's output processing.
    (sb.StepBuffers, "to_device", "buffers.to_device"),
    (sif.StepsInFlight, "fill_from_device", "in_flight.fill_from_device"),
    (cg.DecodeGraphs, "run", "graphs.run"),
    (gvg.GreedyVerifyGraphs, "run", "greedy_graphs.run"),
    (mr.ModelRunner, "_sample", "runner.sample"),
    (mr.ModelRunner, "_end_launch", "runner.end_launch"),
    (mr.ModelRunner, "_update_states", "runner.update_states"),
    (op.OutputProcessor, "process_outputs", "output.process"),
    (Scheduler, "after_launch", "scheduler.after_launch"),
    (le.LLMEngine, "step", "llm.step"),
)
for _owner, _name, _label in TIMED:
    wrap(_owner, _name, _label)

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--model", default=str(Path(__file__).parent / "configs" / "smollm2-135m"))
ap.add_argument("--variants", default="none,gov,nogov")
ap.add_argument("--device", default="cuda")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--output-json", default=None)
ap.add_argument("--attention-backend", default=None, help="attention.backend (default: auto)")
ap.add_argument("--accept-all", action="store_true", help="every draft accepted (see above)")
ap.add_argument("--num-prompts", type=int, default=10)
ap.add_argument("--max-tokens", type=int, default=160)
ap.add_argument(
    "--method",
    default="eagle3",
    choices=["eagle3", "ngram", "suffix"],
    help="the proposer (eagle3: a random head; ngram, suffix: only method set)",
)
ap.add_argument(
    "--trace",
    action="store_true",
    help="then profile one prompt per variant: the device's busy time a step, its kernels",
)
ap.add_argument(
    "--profile",
    action="store_true",
    help="then profile one prompt per variant with cProfile: host us a step by function",
)
args = ap.parse_args()
dev = torch.device(args.device)
if (Path(args.model) / "config.json").exists() and not any(Path(args.model).glob("*.safetensors")):
    folder, _ = ensure_random_weights(Path(args.model), 0, dev)
else:
    folder = args.model
cfg = json.loads((Path(folder) / "config.json").read_text())
if args.accept_all:  # a copy whose final norm is zero: every logit 0, greedy picks token 0
    zeroed = Path(tempfile.mkdtemp())
    for f in Path(folder).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, zeroed / f.name)
            continue
        w = load_file(f)
        if "model.norm.weight" in w:
            w["model.norm.weight"] = torch.zeros_like(w["model.norm.weight"])
        save_file(w, zeroed / f.name, metadata={"format": "pt"})
    folder = zeroed
hdir = Path(tempfile.mkdtemp())
rnd = llama_head_config(
    "eagle3",
    cfg["hidden_size"],
    cfg["intermediate_size"],
    cfg["num_attention_heads"],
    cfg["num_key_value_heads"],
    cfg["vocab_size"],
    draft_vocab_size=min(8192, cfg["vocab_size"] // 2),
)
head_weights = random_head_weights(rnd, seed=1)
if args.accept_all:
    head_weights["norm.weight"] = torch.zeros_like(head_weights["norm.weight"])
write_head(hdir, rnd, head_weights)
base = dict(
    model=str(folder),
    dtype="bfloat16" if dev.type == "cuda" else "float32",
    device=args.device,
    max_model_len=min(1024, cfg.get("max_position_embeddings", 1024)),
    max_num_seqs=4,
    kv_cache_memory_bytes=1 << 30,
    enable_prefix_caching=False,
)
if args.attention_backend:
    base["attention_backend"] = args.attention_backend
spec = {"method": "eagle3", "num_speculative_tokens": 4, "model": str(hdir)}
if args.method != "eagle3":
    spec = {"method": args.method}
variants = args.variants.split(",")
specs = {
    "none": None,
    "gov": spec,
    "off": spec,
    "nogov": {**spec, "adaptive": False},
    "noahead": {**spec, "adaptive": False},
}
_plan_ahead = mr.plan_ahead


def _ahead_launches(llm: LLM) -> int:
    spec = llm.engine.engine_core.executor.worker.model_runner.spec
    return 0 if spec is None else spec.ahead_launches  # no speculation: no runner state for it


def _never_ahead(spec, so):  # noqa: ANN001, ANN202 - variant ``noahead``
    return None


class _Never:
    """A governor that never drafts (variant ``off``)."""

    fixed = False
    counts_requests = False  # (reads no request's tokens)

    def drafting(self, num_running: int) -> bool:
        return False

    def observe(self, *args, **kwargs) -> None: ...

    def admit(self, num_requests: int) -> None: ...

    def idle(self) -> None: ...


engines = {}
for v in variants:
    kw = dict(base)
    if specs[v]:
        kw["speculative_config"] = specs[v]
    engines[v] = LLM(**kw)
    if v == "off":
        engines[v].engine.engine_core.scheduler.spec_governor = _Never()
rng = np.random.default_rng(0)
prompts = [
    {"prompt_token_ids": rng.integers(10, min(40000, cfg["vocab_size"]), 300).tolist()}
    for _ in range(args.num_prompts)
]
params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
tokens = len(prompts) * params.max_tokens
for llm in engines.values():
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
secs: dict[str, list[float]] = {v: [] for v in variants}
timers: dict[str, dict[str, tuple[float, int]]] = {v: {} for v in variants}
drafts = collections.Counter()
accepted = collections.Counter()
with tuned_gc():  # as the engine-core process runs (pagoda.process)
    for _ in range(args.rounds):
        for v, llm in engines.items():
            T.clear()
            N.clear()
            st = llm.engine.engine_core.scheduler.spec_stats_total
            d0, a0 = st.num_drafts, st.num_accepted_tokens
            mr.plan_ahead = _never_ahead if v == "noahead" else _plan_ahead
            t0 = time.perf_counter()
            for p in prompts:
                llm.generate([p], params, use_tqdm=False)
            secs[v].append(time.perf_counter() - t0)
            drafts[v] += st.num_drafts - d0
            accepted[v] += st.num_accepted_tokens - a0
            for k in T:
                t, n = timers[v].get(k, (0.0, 0))
                timers[v][k] = (t + T[k], n + N[k])
median = {v: statistics.median(s) for v, s in secs.items()}
for v, llm in engines.items():
    gov = llm.engine.engine_core.scheduler.spec_governor
    epochs = getattr(gov, "epochs", None)
    tps = [round(tokens / s) for s in secs[v]]
    print(
        f"{v:6s} tok/s {tps}  drafts {drafts[v]}  accepted {accepted[v]}  governor epochs {epochs}"
    )
    for k, (t, n) in sorted(timers[v].items(), key=lambda kv: -kv[1][0]):
        print(f"    {k:28s} {t / n * 1e6 if n else 0:8.1f} us a call  {n / args.rounds:8.0f} calls")
ratios = {v: round(median["none"] / median[v], 3) for v in variants if "none" in median}
print(ratios)
print(
    "verifications launched ahead:",
    {v: _ahead_launches(e) for v, e in engines.items()},
)
# The steps' time less the target's and the head's eager compute (all of a CPU step's compute;
# on a GPU, graph replays are not counted as compute, and the host waits inside ``get``).
per_step = {}
for v in variants:
    t = timers[v]
    launches = t["runner.launch"][1] or 1
    compute = t.get("model.forward", (0.0, 0))[0] + t.get("chain.run", (0.0, 0))[0]
    per_step[v] = round((sum(secs[v]) - compute) / launches * 1e6, 1)
print("us a step, eager compute excluded:", per_step)
runner = engines[variants[0]].engine.engine_core.executor.worker.model_runner


def _shown(model: str) -> str:
    """The model as the report shows it: relative to the repository when inside it."""
    try:
        return str(Path(model).resolve().relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return model


report = {
    "benchmark": "eagle_host_time",
    "command": "python " + " ".join(sys.argv),
    "workload": f"batch 1, {len(prompts)} random prompts of 300 tokens, {params.max_tokens} out",
    "model": f"{_shown(args.model)} (random weights), "
    + ("random EAGLE-3 head" if args.method == "eagle3" else f"{args.method} proposer")
    + (", final norms zeroed: every draft accepted" if args.accept_all else ""),
    "method": args.method,
    "accept_all": args.accept_all,
    "attention_backend": args.attention_backend or "auto",
    "hardware": hardware(runner.device),
    "commit": commit(),
    "dtype": str(runner.dtype),
    "rounds": args.rounds,
    "tokens_per_s": {v: [round(tokens / s, 1) for s in secs[v]] for v in variants},
    "ratio_to_none": ratios,
    "drafts": dict(drafts),
    "us_per_step_excluding_eager_compute": per_step,
    "accepted_tokens": dict(accepted),
    "verifications_launched_ahead": {v: _ahead_launches(llm) for v, llm in engines.items()},
    "host_us_per_call": {
        v: {k: round(t / n * 1e6, 1) for k, (t, n) in timers[v].items() if n} for v in variants
    },
}


def _idle_by_phase(spans: list, ranges: list) -> dict[str, float]:
    """The device's idle time between its first and last kernel, by what the host was doing
    meanwhile: the innermost wrapped function running (``engine.step`` when none inside it is,
    ``(outside)`` between engine steps). The wrapped calls run on one thread, so they nest."""
    gaps, end = [], None
    for a, b in spans:
        if end is not None and a > end:
            gaps.append((end, a))
        end = b if end is None else max(end, b)
    # The host's timeline as segments (from, to, innermost function), by a sweep over the
    # calls' starts and ends (an end before a start at the same moment).
    marks = sorted(
        [(r[0], 1, i) for i, r in enumerate(ranges)] + [(r[1], 0, i) for i, r in enumerate(ranges)]
    )
    segments, stack, prev = [], [], None
    for t, is_start, i in marks:
        if prev is not None and t > prev:
            segments.append((prev, t, ranges[stack[-1]][2] if stack else "(outside)"))
        if is_start:
            stack.append(i)
        elif i in stack:
            stack.remove(i)
        prev = t
    out: dict[str, float] = collections.defaultdict(float)
    j = 0
    for a, b in gaps:
        while j < len(segments) and segments[j][1] <= a:
            j += 1
        x, k = a, j
        while x < b:
            if k >= len(segments) or segments[k][0] >= b:
                out["(outside)"] += b - x
                break
            s0, s1, name = segments[k]
            if s0 > x:
                out["(outside)"] += min(s0, b) - x
                x = min(s0, b)
                continue
            y = min(s1, b)
            out[name] += y - x
            x, k = y, k + 1
    return dict(out)


def _trace(llm) -> dict:
    """One prompt under the torch profiler: wall time a step, the time a step's kernels keep the
    device busy (the union of their intervals; what is left is the device waiting for the
    host), and the kernels that take longest."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and runner.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts):  # the profiler's own start-up, not timed
        llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    n0 = N["runner.launch"]
    t0 = time.perf_counter()
    TRACING[0] = True
    try:
        with profile(activities=acts) as prof:
            llm.generate([prompts[0]], params, use_tqdm=False)
            if cuda:
                torch.cuda.synchronize()
    finally:
        TRACING[0] = False
    wall = time.perf_counter() - t0
    steps = max(N["runner.launch"] - n0, 1)
    # NOTE: under --trace the wrapped calls show on the device too (annotations), not as kernels.
    kernels = [
        e for e in prof.events() if e.device_type == DeviceType.CUDA and e.name not in LABELS
    ]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for e in kernels:
        per_kernel[e.name[:80]] += e.time_range.end - e.time_range.start
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    ranges = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type != DeviceType.CUDA and e.name in LABELS
    ]
    idle = _idle_by_phase(spans, ranges) if cuda else {}
    return {
        "steps": steps,
        "wall_us_per_step": round(wall / steps * 1e6, 1),
        "device_idle_us_per_step_by_host_phase": {
            k: round(v / steps, 1) for k, v in sorted(idle.items(), key=lambda kv: -kv[1])
        },
        "device_busy_us_per_step": round(busy / steps, 1) if cuda else None,
        "kernels_per_step": round(len(kernels) / steps, 1) if cuda else None,
        "top_kernels_us_per_step": {k: round(v / steps, 1) for k, v in top},
    }


def _where(key: tuple) -> str:
    """A function as ``folder/file.py:line(name)``, without the machine's paths."""
    path, line, name = key
    tail = "/".join(Path(path).parts[-2:]) if path != "~" else ""
    return f"{tail}:{line}({name})" if tail else name


def _cprofile(llm) -> dict:
    """Host time a step by function for one prompt (cProfile; it slows Python calls alike, so
    the shares are what to read): the top functions by their own time and by their total."""
    import cProfile
    import pstats

    n0 = N["runner.launch"]
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([prompts[0]], params, use_tqdm=False)
    prof.disable()
    steps = max(N["runner.launch"] - n0, 1)
    stats = pstats.Stats(prof).stats  # key -> (calls, primitive calls, tottime, cumtime, ...)

    def top(i: int, count: int) -> dict:
        rows = sorted(stats.items(), key=lambda kv: -kv[1][i])[:count]
        return {_where(k): round(v[i] / steps * 1e6, 1) for k, v in rows}

    return {"steps": steps, "own_us_per_step": top(2, 40), "total_us_per_step": top(3, 60)}


if args.profile:
    report["profile"] = {}
    for v, llm in engines.items():
        report["profile"][v] = pr = _cprofile(llm)
        print(f"profile {v}: {pr['steps']} steps; own us a step:")
        for k, us in list(pr["own_us_per_step"].items())[:15]:
            print(f"    {us:8.1f}  {k}")

if args.trace:
    report["trace"] = {}
    for v, llm in engines.items():
        report["trace"][v] = tr = _trace(llm)
        busy = tr["device_busy_us_per_step"]
        print(f"trace {v:6s} {tr['wall_us_per_step']:8.1f} us a step, device busy {busy} us")
        for k, us in list(tr["device_idle_us_per_step_by_host_phase"].items())[:12]:
            print(f"    {us:8.1f} us idle in {k}")
        for k, us in tr["top_kernels_us_per_step"].items():
            print(f"    {us:8.1f} us  {k}")
where = "cpu"
if runner.device.type == "cuda":
    where = report["hardware"].lower().replace("nvidia ", "").replace(" ", "-")
name = "eagle-host-time" if args.method == "eagle3" else f"spec-host-time-{args.method}"
path = save_report(report, f"{name}-b1-{where}-{report['commit']}", args.output_json)
print("results:", path)
