"""Speculative decoding: tokens/s with and without it, acceptance rate and mean acceptance length.

Prompt sets (``--prompts``): ``copy`` (the default), 18 prompts that ask the model to repeat,
edit or summarise text they give (standard-library source and documentation, chat-templated
for an instruct model): output repeats the input, which is where n-gram and suffix drafts pay;
``open``, 16 open questions with nothing to copy (the overhead case for a history proposer);
``random``, random token ids generated to ``--max-tokens`` (for batch 64: the governor's case);
``stdlib``, the older input-grounded set. ``--random-weights CONFIG_DIR`` runs random weights on
random prompts. Only ``--method`` is set unless the other speculative options are given.

Both engines live in one process and each request (or batch) runs on one, then on the other, in
alternating order, so a machine shared with other work slows both alike; the figure is the ratio.

    python benchmarks/spec_decode.py [--method ngram] [--prompts copy] [--batch-size 1]
    python benchmarks/spec_decode.py --method suffix --prompts open
    python benchmarks/spec_decode.py --prompts random --batch-size 64 --num-prompts 128 \
        --device cuda --dtype bfloat16
    python benchmarks/spec_decode.py --suite gpu --device cuda   # issue 44's table, one command

On a GPU both engines replay CUDA graphs (decode steps, and verification steps of k + 1 tokens a
request); the report counts the engine steps each took.
"""

from __future__ import annotations

import argparse
import bisect
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.device import KernelCompiles
from pagoda.bench.report import commit, hardware, save_report
from pagoda.process import tuned_gc
from pagoda.scheduler.spec_governor import build_governor

# (module, attribute or None for the module's docstring)
_SOURCES = [
    ("textwrap", "TextWrapper._wrap_chunks"),
    ("json.encoder", "py_encode_basestring_ascii"),
    ("shlex", "split"),
    ("heapq", "merge"),
    ("textwrap", "dedent"),
    ("fnmatch", "translate"),
    ("statistics", "median"),
    ("colorsys", "rgb_to_hls"),
    ("base64", "b32encode"),
]
_DOCS = ["json", "argparse", "csv", "textwrap", "heapq", "shlex", "fnmatch", "bisect", "colorsys"]


def _source(module: str, attr: str) -> str:
    obj: Any = __import__(module, fromlist=["_"])
    for part in attr.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(obj)


def grounded_prompts(n: int) -> list[tuple[str, str]]:
    """(kind, user message), cycling through repeat, edit and summarise."""
    out = []
    for i in range(n):
        kind = ("repeat", "edit", "summarise")[i % 3]
        module, attr = _SOURCES[i % len(_SOURCES)]
        if kind == "repeat":
            src = _source(module, attr)
            text = f"Repeat this code exactly:\n```python\n{src}```"
        elif kind == "edit":
            src = _source(module, attr)
            text = (
                "Add type hints to this function and return the whole function, unchanged "
                f"otherwise:\n```python\n{src}```"
            )
        else:
            doc = inspect.getdoc(__import__(_DOCS[i // 3 % len(_DOCS)], fromlist=["_"])) or ""
            text = f"Summarise this documentation, quoting its key sentences:\n\n{doc[:2500]}"
        out.append((kind, text))
    return out


# The copy set's own texts: functions to repeat or edit, modules whose documentation to summarise.
_COPY_SOURCES = [
    ("textwrap", "dedent"),
    ("shlex", "split"),
    ("heapq", "merge"),
    ("fnmatch", "translate"),
    ("statistics", "median"),
    ("colorsys", "rgb_to_hls"),
    ("textwrap", "TextWrapper._wrap_chunks"),
    ("json.encoder", "py_encode_basestring_ascii"),
    ("random", "Random.shuffle"),
    ("textwrap", "indent"),
    ("calendar", "Calendar.itermonthdays"),
    ("string", "capwords"),
]
_COPY_DOCS = ["json", "csv", "heapq", "argparse", "statistics", "difflib"]
_EDITS = [
    "Add type hints to this function and return the whole function, unchanged otherwise",
    "Rename the function to `{name}_v2` and return the whole function, unchanged otherwise",
    "Add a comment line above each `return` and return the whole function, unchanged otherwise",
]

#: Open questions: nothing in the prompt to copy (the non-copy set).
OPEN_QUESTIONS = [
    "Why is the sky blue? Explain it to a curious ten-year-old.",
    "What are three good habits for staying healthy while working from home?",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What is the difference between weather and climate?",
    "Give me some ideas for a birthday party for a seven-year-old.",
    "How do bees make honey?",
    "What should I pack for a week-long hiking trip in the mountains?",
    "Explain how a bicycle stays upright when it moves.",
    "Write a poem about autumn leaves.",
    "What are the pros and cons of living in a big city?",
    "How can I become better at public speaking?",
    "Describe a typical day in the life of a medieval blacksmith.",
    "What is photosynthesis and why does it matter?",
    "Suggest a simple recipe for dinner using rice, eggs and vegetables.",
    "Why do people enjoy music?",
    "What would happen if the moon disappeared?",
]


def copy_prompts() -> list[tuple[str, str]]:
    """The copy-task set: (kind, user message) for 18 prompts, 6 each that repeat, edit or
    summarise text given in the prompt (standard-library source and documentation)."""
    out = []
    for i, (module, attr) in enumerate(_COPY_SOURCES):
        src = _source(module, attr)[:1500]
        if i % 2 == 0:
            out.append(("repeat", f"Repeat this code exactly:\n```python\n{src}```"))
        else:
            ask = _EDITS[i // 2 % len(_EDITS)].format(name=attr.split(".")[-1])
            out.append(("edit", f"{ask}:\n```python\n{src}```"))
    for name in _COPY_DOCS:
        doc = inspect.getdoc(__import__(name, fromlist=["_"])) or ""
        text = f"Summarise this documentation, quoting its key sentences:\n\n{doc[:2000]}"
        out.append(("summarise", text))
    return out


def prompt_set(name: str, n: int | None) -> list[tuple[str, str]]:
    """The ``--prompts`` set's (kind, user message) pairs, the first ``n`` (None: all; the
    ``stdlib`` set, the older input-grounded one, cycles to any ``n``, 9 by default)."""
    if name == "copy":
        got = copy_prompts()
    elif name == "open":
        got = [("open", q) for q in OPEN_QUESTIONS]
    else:
        return grounded_prompts(9 if n is None else n)
    return got if n is None else [got[i % len(got)] for i in range(n)]


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM`` arguments from the workload options (``add_workload_arguments``)."""
    kw: dict[str, Any] = {"max_model_len": args.max_model_len, "device": args.device}
    kw.update({k: v for k, v in (("model", args.model), ("dtype", args.dtype)) if v})
    return kw


def _build(args: argparse.Namespace, spec: dict | None) -> LLM:
    kw = {**engine_args(args), "max_num_seqs": max(args.batch_size, 1)}
    if args.kv_cache_memory_bytes:  # two engines share the device: size each cache
        kw["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if spec is not None:
        kw["speculative_config"] = spec
    return LLM(**kw)


def workload_prompts(args: argparse.Namespace, llm: LLM) -> tuple[list[dict], list[str]]:
    if args.random_weights or args.prompts == "random":
        rng = np.random.default_rng(0)
        vocab = llm.engine.engine_core.executor.worker.model_runner.shape.vocab_size
        n = args.num_prompts or 9
        ids = rng.integers(10, min(10_000, vocab), (n, args.input_len))
        return [{"prompt_token_ids": row.tolist()} for row in ids], ["random"] * n
    tok = llm.get_tokenizer()
    prompts, kinds = [], []
    chosen = prompt_set(args.prompts, args.num_prompts)
    if getattr(args, "kinds", None):
        chosen = [(kind, text) for kind, text in chosen if kind in args.kinds.split(",")]
    for kind, text in chosen:
        messages = [{"role": "user", "content": text}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        prompts.append({"prompt_token_ids": list(ids)[: args.max_model_len - args.max_tokens - 1]})
        kinds.append(kind)
    return prompts, kinds


def _warm_prompts(args: argparse.Namespace, llm: LLM, n: int) -> list[dict]:
    """``n`` prompts like the workload's, none of them measured."""
    if args.random_weights or args.prompts == "random":
        rng = np.random.default_rng(1)
        vocab = llm.engine.engine_core.executor.worker.model_runner.shape.vocab_size
        ids = rng.integers(10, min(10_000, vocab), (n, args.input_len))
        return [{"prompt_token_ids": row.tolist()} for row in ids]
    other = argparse.Namespace(**{**vars(args), "prompts": "stdlib", "num_prompts": None})
    other.kinds = None
    prompts = workload_prompts(other, llm)[0]
    return (prompts * (n // max(len(prompts), 1) + 1))[:n]


def add_workload_arguments(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """The model, device and workload options (``workload_prompts``, ``use_random_weights``)."""
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2)")
    p.add_argument("--random-weights", default=None, metavar="CONFIG_DIR")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument(
        "--prompts",
        choices=("copy", "open", "stdlib", "random"),
        default="copy",
        help="copy: 18 prompts that repeat, edit or summarise text they give; open: 16 open "
        "questions; stdlib: the older input-grounded set; random: random token ids "
        "(--input-len), generated to --max-tokens",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="default: the whole set")
    p.add_argument("--kinds", default=None, help="only these kinds of the set (repeat,edit,...)")
    p.add_argument("--input-len", type=int, default=256, help="random prompts only")
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--max-model-len", type=int, default=2048)


def use_random_weights(args: argparse.Namespace) -> None:
    """``--random-weights CONFIG_DIR``: the model is that config's random weights (made once);
    with ``--all-accepted``, a copy whose final norm is zero (:func:`all_accepted_copy`)."""
    if args.random_weights:
        from pagoda.bench.random_weights import ensure_random_weights

        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        folder, _ = ensure_random_weights(Path(args.random_weights), 0, dev)
        if getattr(args, "all_accepted", False):
            folder = all_accepted_copy(folder)
        args.model = str(folder)
    elif getattr(args, "all_accepted", False):
        raise SystemExit("--all-accepted takes --random-weights CONFIG_DIR")


def all_accepted_copy(folder: Path) -> Path:
    """A copy of the random-weights ``folder`` whose final norm's weight is zero: every logit is
    0, greedy decoding repeats token 0, and once the history repeats every draft of the n-gram
    and suffix proposers is accepted. What is left to measure is the cost of speculating
    itself: with a tiny model on a CPU, the host's work a verification step adds (a GPU at
    batch 1 is paced by that work too)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = folder.with_name(folder.name + "-all-accepted")
    if not out.is_dir():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(folder, tmp)
        files = [f for f in tmp.glob("*.safetensors") if "model.norm.weight" in load_file(f)]
        if not files:
            raise SystemExit(f"{folder} has no model.norm.weight to zero")
        state = load_file(files[0])
        state["model.norm.weight"] = torch.zeros_like(state["model.norm.weight"])
        save_file(state, files[0], metadata={"format": "pt"})
        tmp.rename(out)
    return out


_WORKLOADS = {
    "copy": "copy set (repeat, edit, summarise stdlib source and docs given in the prompt)",
    "open": "open questions (nothing in the prompt to copy)",
    "stdlib": "input-grounded (stdlib source, docs)",
    "random": "random token ids",
}


def report_head(benchmark: str, args: argparse.Namespace, runner: Any) -> dict[str, Any]:
    """What every report of the workload starts with: the command, workload, model, hardware,
    commit and dtype."""
    model = args.random_weights or args.model or "SmolLM2-135M-Instruct (default)"
    if args.random_weights and getattr(args, "all_accepted", False):
        model += " (final norm zeroed: every draft accepted)"
    return {
        "benchmark": benchmark,
        "command": "python " + " ".join(sys.argv),
        "workload": _WORKLOADS["random" if args.random_weights else args.prompts],
        "model": model,
        "hardware": hardware(runner.device),
        "commit": commit(),
        "dtype": str(runner.dtype),
    }


def report_slugs(report: dict[str, Any], runner: Any) -> tuple[str, str]:
    """The model's and the hardware's part of a report's file name."""
    where = "cpu"
    if runner.device.type == "cuda":
        where = report["hardware"].lower().replace("nvidia ", "").replace(" ", "-")
    return Path(report["model"].split()[0]).name.lower().removesuffix(".gguf"), where


def _timed(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, list[list[int]]]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def _count_steps(llm: LLM) -> dict[str, int]:
    """Counts the engine's steps and those that carried drafts (or draft slots)."""
    scheduler = llm.engine.engine_core.scheduler
    counts = {"steps": 0, "steps_with_drafts": 0}
    schedule = scheduler.schedule

    def counting() -> Any:
        so = schedule()
        counts["steps"] += not so.is_empty
        counts["steps_with_drafts"] += bool(so.scheduled_spec_decode_tokens)
        return so

    scheduler.schedule = counting
    return counts


def _proposer(llm: LLM) -> Any:
    spec = llm.engine.engine_core.executor.worker.model_runner.spec
    return None if spec is None else spec.proposer


def _count_proposals(llm: LLM) -> dict[str, int]:
    """Counts the proposer's calls by outcome, for each request asked: drafted, no match
    (nothing of the history recurs; n-gram), or matched but not drafted (the proposer judged
    the draft not worth its cost). A few attribute reads a call: the spec engine's host time is
    what the benchmark measures."""
    counts = {"asked": 0, "drafted": 0, "no_match": 0, "not_worth": 0}
    proposer = _proposer(llm)
    if proposer is None:
        return counts
    propose = proposer.propose
    adapt = getattr(proposer, "adapt", None)

    def counting(batch: Any) -> Any:
        got = propose(batch)
        if not isinstance(got.token_ids, np.ndarray):  # (drafts on the device: not counted)
            return got
        first = got.token_ids[:, 0] >= 0 if got.token_ids.shape[1] else np.zeros(0, bool)
        n, drafted = len(batch.rows), int(first.sum())
        counts["asked"] += n
        counts["drafted"] += drafted
        if adapt is not None and drafted < n:
            matched = int((adapt.match[batch.rows[~first]] > 0).sum())
            counts["not_worth"] += matched
            counts["no_match"] += n - drafted - matched
        return got

    proposer.propose = counting
    return counts


def _draft_cost(proposer: Any, batch_size: int) -> dict[str, Any] | None:
    """What the proposer's draft-cost model measured (``pagoda.spec_decode.DraftCost``): per
    batch-size bucket, a step's seconds without drafts and per draft token; the tokens a request
    gained a step; the least acceptance probability a draft needed at the measured batch size.
    With the n-gram proposer's measured acceptance: of the first draft by the length of the match
    it came from, and of each later position given the ones before."""
    adapt = getattr(proposer, "adapt", None)
    cost = getattr(proposer, "cost", None) or getattr(adapt, "cost", None)
    if cost is None:
        return None
    fits = {}
    for b, fit in sorted(cost.fits.items()):
        got = fit.fit()  # (None: the draft counts have not varied enough yet)
        bucket = f"{1 << (b - 1)}-{(1 << b) - 1}"
        fits[bucket] = None
        if got is not None:
            fits[bucket] = {
                "step_ms_without_drafts": round(got[0] * 1e3, 4),
                "ms_per_draft_token": round(got[1] * 1e3, 4),
            }
    out: dict[str, Any] = {
        "fits": fits,
        "tokens_gained_per_step": round(cost.emitted, 3),
        "threshold": round(cost.threshold(batch_size), 4),
    }
    if adapt is not None:
        first = adapt.first_hits / adapt.first_trials
        out["first_draft_acceptance_by_match_length"] = {
            str(m): round(float(first[m]), 3) for m in range(1, len(first))
        }
        out["acceptance_by_position"] = [round(float(r), 3) for r in adapt.g_hits / adapt.g_trials]
    return out


def _graph_replays(llm: LLM) -> dict[str, int]:
    runner = llm.engine.engine_core.executor.worker.model_runner
    graphs = {"decode": getattr(runner, "decode_graphs", None)}
    graphs["piecewise"] = getattr(runner, "piecewise", None)  # (steps with prompt tokens)
    graphs["verify"] = runner.spec.verify_graphs if runner.spec is not None else None
    got = {k: g.replays for k, g in graphs.items() if g is not None}
    if runner.spec is not None:  # (verifications replayed before the step in flight was read)
        got["verify_ahead"] = runner.spec.ahead_launches
    return got


def _profile(engines: dict[str, LLM], batch: list[dict], params: SamplingParams, n: int) -> None:
    import cProfile
    import io
    import pstats

    for name, llm in engines.items():
        prof = cProfile.Profile()
        prof.enable()
        _timed(llm, batch, params)
        prof.disable()
        for order in ("tottime", "cumulative"):  # own time, then with what each calls
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(n)
            print(f"--- profile: {name}, by {order}\n{text.getvalue()}", file=sys.stderr)


# Issue 44's figures: (dtype, prompts, batch size, method, max tokens, prompts' count).
_GPU_SUITE = [
    (dtype, prompts, 1, method, 128, None)
    for dtype in ("bfloat16", "float32")
    for prompts in ("copy", "open")
    for method in ("ngram", "suffix")
] + [(dtype, "random", 64, "ngram", 128, 128) for dtype in ("bfloat16", "float32")]


def _timeline(engines: dict[str, LLM], batch: list[dict], params: SamplingParams) -> dict:
    """One more pass of ``batch`` on each engine under torch's profiler: the device's busy and
    idle time, and the host work it waited for (:mod:`pagoda.bench.timeline`; on the
    benchmark's own prompts, where ``benchmarks/eagle_host_time.py --trace`` runs random
    weights)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from pagoda.bench.timeline import annotated, device_timeline

    out = {}
    for name, llm in engines.items():
        targets = _host_targets(llm)
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities) as prof, annotated(targets):
            with record_function("spec_decode.call"):
                _timed(llm, batch, params)
        got = device_timeline(prof.events(), "spec_decode.call")
        got["steps"] = sum(1 for e in prof.events() if e.name.endswith("timeline.launch"))
        out[name] = got
        print(f"--- timeline: {name}\n{json.dumps(got, indent=1)}", file=sys.stderr)
    return out


def _host_targets(llm: LLM) -> list[tuple[Any, str, str]]:
    """The engine's host parts a pass is timed or annotated by (:mod:`pagoda.bench.timeline`):
    ``(owner, attribute, label)``; those of a plain engine's runner only where it has them."""
    import pagoda.worker.draft_slots as draft_slots
    import pagoda.worker.model_runner as model_runner
    from pagoda.worker.step_output import StepOutput

    core = llm.engine.engine_core
    runner = core.executor.worker.model_runner
    spec = runner.spec
    if spec is None:
        spec = SimpleNamespace(proposer=None, late=None, verify_graphs=None)  # (owners: none)
    return [
        (llm.engine, "step", "engine_step"),
        (llm.engine.output_processor, "process_outputs", "process_outputs"),
        (core.scheduler, "schedule", "schedule"),
        (core.scheduler, "after_launch", "after_launch"),
        (core.scheduler, "update_from_output", "update_from_output"),
        (core.scheduler.spec_governor, "observe", "governor.observe"),
        (core.executor, "launch", "launch"),
        (core, "_finish", "finish"),
        (StepOutput, "get", "read_step"),
        (StepOutput, "_build", "build"),
        (runner, "_update_states", "update_states"),
        (runner, "_sample", "sample"),
        (runner, "_propose", "propose_after"),
        (runner.in_flight, "read_all", "read_all"),
        (runner.in_flight, "settle", "settle"),
        (runner.decode_graphs, "run", "decode_graph"),
        (model_runner, "propose_for_slots", "propose_for_slots"),
        (draft_slots, "propose", "propose"),
        (spec.proposer, "propose", "proposer.propose"),
        (spec.proposer, "settle", "proposer.settle"),
        (spec.late, "release", "release"),
        (model_runner, "fill_draft_slots", "fill_draft_slots"),
        (model_runner, "run_verify_graph", "run_verify_graph"),
        (model_runner, "verify_drafts", "verify_drafts"),
        (spec.verify_graphs, "run", "verify_graph"),
    ]


def _host_path(llm: LLM, batch: list[dict], params: SamplingParams) -> dict[str, Any]:
    """One more pass of ``batch`` on ``llm`` with a clock around the host's parts
    (:func:`pagoda.bench.timeline.timed`, no profiler): where a late-draft step's cycle goes,
    and each part's median a step (on both engines: the parts a plain step shares).

    A verification launched ahead waits on the device for its drafts; the host writes them
    once it has read the step in flight and proposed. Per such launch: ``read_to_release``
    (from the read's wait ending to the drafts released: the device waits through all of it),
    ``release_to_read`` (the host's other work: the rest of the launch, the scheduler's update,
    the outputs, the next schedule and launch up to its read) and ``read_wait`` (the host
    waiting for the device). Medians in microseconds, with each wrapped part's median a step."""
    from pagoda.bench.timeline import timed

    targets = _host_targets(llm)
    log: list[tuple[str, int, int]] = []
    with timed(targets, lambda label, a, b: log.append((label, a, b))):
        _timed(llm, batch, params)
    per: dict[str, list[float]] = {}
    for label, a, b in log:
        per.setdefault(label, []).append((b - a) / 1e3)
    # (a read's output is built once its wait ended: the build's start marks that end)
    gets = sorted(a for label, a, _ in log if label == "read_step")
    builds = sorted(a for label, a, _ in log if label == "build")
    releases = sorted(b for label, _, b in log if label == "release")
    cycle: dict[str, list[float]] = {"read_to_release": [], "release_to_read": [], "read_wait": []}
    for r in releases:
        i = bisect.bisect_right(builds, r)  # builds[i - 1]: the read it followed; [i]: the next
        if i == 0 or i == len(builds):
            continue
        cycle["read_to_release"].append((r - builds[i - 1]) / 1e3)
        j = bisect.bisect_right(gets, builds[i])  # gets[j - 1]: the next read's start
        if j and gets[j - 1] >= r:
            cycle["release_to_read"].append((gets[j - 1] - r) / 1e3)
            cycle["read_wait"].append((builds[i] - gets[j - 1]) / 1e3)
    med = lambda v: round(float(np.median(v)), 1) if v else None  # noqa: E731
    return {
        "late_launches": len(cycle["read_to_release"]),
        "cycle_median_us": {k: med(v) for k, v in cycle.items()},
        "median_us": {k: med(v) for k, v in sorted(per.items())},
        "calls": {k: len(v) for k, v in sorted(per.items())},
    }


def _plain_overhead(
    engines: dict[str, LLM], batch: list[dict], params: SamplingParams, passes: int
) -> dict[str, Any]:
    """What a plain step costs the speculating engine beyond the plain engine's: ``passes``
    more passes of ``batch`` on each engine in turn (the order flipped each pass, so that the
    host's drift between passes falls on both), the speculating engine's drafting held off
    (``speculative.disable_by_batch_size`` of 1: its governor never drafts), each host part
    timed per step (:func:`pagoda.bench.timeline.timed`). Each part's median over the steps of
    every pass but each pass's first 10 (prompts, admissions) and last 5 (a batch draining), in
    microseconds, and each engine's pass times. Then ``passes`` more on each in turn without the
    clocks (their wrappers cost a microsecond or two a call, more calls on the speculating
    engine): the ratio of the median passes. Where a large batch is host-bound (a step of 1.5 ms
    at batch 64 on an H200) this is what drafting held off still costs every step."""
    from pagoda.bench.timeline import timed
    from pagoda.scheduler.spec_governor import SpeculationGovernor

    scheduler = engines["spec"].engine.engine_core.scheduler
    kept = scheduler.spec_governor
    scheduler.spec_governor = SpeculationGovernor(disable_by_batch_size=1, fixed=True)
    per: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    untimed: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for i in range(passes):
            for name in ("off", "spec") if i % 2 == 0 else ("spec", "off"):
                log: list[tuple[str, int, int]] = []
                with timed(_host_targets(engines[name]), lambda *e, log=log: log.append(e)):
                    dt, _ = _timed(engines[name], batch, params)
                seconds[name].append(round(dt, 4))
                steps = sorted((a, b) for label, a, b in log if label == "engine_step")
                starts = [a for a, _ in steps]
                parts: list[dict[str, float]] = [{} for _ in steps]
                for label, a, b in log:
                    j = bisect.bisect_right(starts, a) - 1
                    if label != "engine_step" and j >= 0 and a < steps[j][1]:
                        parts[j][label] = parts[j].get(label, 0.0) + (b - a) / 1e3
                for (a, b), got in list(zip(steps, parts))[10:-5]:
                    got["engine_step"] = (b - a) / 1e3
                    for label, us in got.items():
                        per[name].setdefault(label, []).append(us)
        for i in range(passes):
            for name in ("spec", "off") if i % 2 == 0 else ("off", "spec"):
                untimed[name].append(round(_timed(engines[name], batch, params)[0], 4))
    finally:
        scheduler.spec_governor = kept
    med = {name: float(np.median(v)) for name, v in seconds.items()}
    bare = {name: float(np.median(v)) for name, v in untimed.items()}
    return {
        "passes": passes,
        "pass_seconds": seconds,
        "spec_over_off_median_pass": round(med["spec"] / med["off"], 4),
        "untimed_pass_seconds": untimed,
        "spec_over_off_median_untimed_pass": round(bare["spec"] / bare["off"], 4),
        "steps": {name: len(got.get("engine_step", ())) for name, got in per.items()},
        "median_us": {
            name: {k: round(float(np.median(v)), 1) for k, v in sorted(got.items())}
            for name, got in per.items()
        },
    }


def run_suite(args: argparse.Namespace) -> None:
    """Each configuration of the suite in a process of its own (this script, with only
    ``--method`` among the speculative options), then one table of the figures."""
    here = Path(__file__).resolve()
    rows = []
    # NOTE: --dtype (and --method) given with --suite run that part of it alone.
    suite = [c for c in _GPU_SUITE if args.dtype in (None, c[0])]
    if args.method_given:
        suite = [c for c in suite if c[3] == args.method]
    for dtype, prompts, batch, method, max_tokens, n in suite:
        cmd = [sys.executable, str(here), "--method", method, "--prompts", prompts]
        cmd += ["--batch-size", str(batch), "--dtype", dtype, "--max-tokens", str(max_tokens)]
        cmd += ["--device", args.device]
        if n is not None:
            cmd += ["--num-prompts", str(n)]
        if args.model:
            cmd += ["--model", args.model]
        print("$ " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in done.stdout.splitlines() if x.startswith("results: ")]
        if done.returncode or not line:
            print(done.stderr[-3000:], file=sys.stderr)
            rows.append((dtype, prompts, batch, method, None, None, None, None))
            continue
        rep = json.loads(Path(line[-1].removeprefix("results: ")).read_text())
        rows.append(
            (
                dtype, prompts, batch, method, rep["speedup"], rep["speedup_median_of_batches"],
                rep["mean_acceptance_length"], rep["greedy_outputs_identical"],
            )
        )  # fmt: skip
    print("| dtype | prompts | batch | method | speedup | median of batches | MAL | same |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join("-" if v is None else str(v) for v in row) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(p, max_tokens=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument(
        "--all-accepted",
        action="store_true",
        help="with --random-weights: zero the final norm, so that greedy output repeats one "
        "token and every draft is accepted (the cost of speculating itself, on a host-bound "
        "tiny model)",
    )
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--method", default="ngram", help="speculative.method (ngram, suffix, ...)")
    p.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="default: unset (the proposer's)"
    )
    p.add_argument("--prompt-lookup-min", type=int, default=None, help="default: unset")
    p.add_argument("--prompt-lookup-max", type=int, default=None, help="default: unset")
    p.add_argument(
        "--suite",
        choices=("gpu",),
        default=None,
        help="gpu: run issue 44's matrix (bfloat16 and float32; copy and open sets at batch 1 "
        "for ngram and suffix; batch 64 random prompts for ngram), each in a process of its "
        "own with only the method set, and print one table; with --dtype or --method, only "
        "that part",
    )
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    p.add_argument("--output-json", default=None)
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, profile one more pass of the first batch per engine (cProfile) and "
        "print its N costliest functions by own time, then by time with what they call",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="after timing, one more pass of the first batch per engine under torch's profiler "
        "(a GPU): the device's busy and idle time and the host work it waited for, in the report",
    )
    p.add_argument(
        "--host-path",
        action="store_true",
        help="after timing, one more pass of the first batch on each engine with a clock "
        "around the host's parts: each part's median a step, and the late-draft cycle (read to "
        "release, release to the next read, the read's wait), in the report",
    )
    p.add_argument(
        "--plain-overhead",
        type=int,
        default=0,
        metavar="N",
        help="after timing, N more passes of the first batch on each engine in turn, the spec "
        "engine's drafting held off: each host part's median per step on both (what a plain "
        "step of the speculating engine costs beyond the plain engine's), then N more without "
        "the clocks (the ratio of the median passes), in the report",
    )
    p.add_argument(
        "--no-adaptive",
        action="store_true",
        help="speculative.adaptive: false (draft every step; no governor measuring whether "
        "drafting pays)",
    )
    p.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="speculative.disable_by_batch_size"
    )
    args = p.parse_args()
    args.method_given = "--method" in sys.argv
    if args.suite:
        run_suite(args)
        return
    if args.device != "cpu" and torch.cuda.is_available() and not args.kv_cache_memory_bytes:
        # NOTE: both engines live in one process, and the second one's memory profile would
        # count the first one's KV cache as used (gpu_memory_utilization is of the whole GPU):
        # each gets an explicit quarter of the memory free now.
        args.kv_cache_memory_bytes = int(torch.cuda.mem_get_info()[0] * 0.25)
    use_random_weights(args)
    spec: dict[str, Any] = {"method": args.method}
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    if args.no_adaptive:
        spec["adaptive"] = False
    if args.disable_by_batch_size:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    engines = {"off": _build(args, None), "spec": _build(args, spec)}
    prompts, kinds = workload_prompts(args, engines["off"])
    random = bool(args.random_weights) or args.prompts == "random"
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=random)
    # Warm-up: first-call costs (allocations, kernel launch caches, host buffers, kernels
    # compiled for longer contexts and for each verification length) at the batch size
    # measured out of the way: the first batches whole, at the measured length. With 16 tokens
    # of one prompt, an H200 run (50a063c) met compiles in its first two timed batches, one on
    # each engine (ratios 17.8 and 0.14), and they decided the whole figure. What the
    # speculation governor learned in it is forgotten: the measured passes pay its exploration
    # from the start.
    # The warm-up's prompts are not the measured ones (the suffix proposer's global tree would
    # keep their answers): the stdlib set's, or random ids of another seed.
    warm = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm_prompts = _warm_prompts(
        args, engines["off"], args.batch_size * (1 if args.batch_size > 1 else 3)
    )
    for llm in engines.values():
        for i in range(0, len(warm_prompts), args.batch_size):
            llm.generate(warm_prompts[i : i + args.batch_size], warm, use_tqdm=False)
    core = engines["spec"].engine.engine_core
    gov = core.scheduler.spec_governor
    if gov is not None:
        paced = gov.self_paced_below > 0
        core.scheduler.spec_governor = build_governor(
            core.config.speculative, self_paced=paced, plain_first_from=gov.plain_first_from
        )
    stats = engines["spec"].engine.engine_core.scheduler.spec_stats_total
    drafts0, draft_tokens0, accepted0 = (
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
    )
    steps = {name: _count_steps(llm) for name, llm in engines.items()}
    proposals = _count_proposals(engines["spec"])
    replays0 = {name: _graph_replays(llm) for name, llm in engines.items()}
    seconds = {"off": 0.0, "spec": 0.0}
    tokens = {"off": 0, "spec": 0}
    same = True
    batch_ratios: list[float] = []  # each batch's speculation ratio, in the order run
    batch_detail: list[dict[str, list[float]]] = []  # each batch's [tokens, seconds] by engine
    batches = [
        prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)
    ] * args.repeats
    compiles = KernelCompiles()
    with tuned_gc(), compiles:  # (tuned_gc: as the engine-core process runs, pagoda.process)
        for b, batch in enumerate(batches):
            order = ("off", "spec") if b % 2 == 0 else ("spec", "off")
            outs = {}
            rate = {}  # this batch's tokens/s on each engine
            detail = {}
            for name in order:
                compiles.where = f"batch {b}, {name}"
                dt, outs[name] = _timed(engines[name], batch, params)
                n = sum(len(o) for o in outs[name])
                seconds[name] += dt
                tokens[name] += n
                rate[name] = n / dt
                detail[name] = [n, round(dt, 4)]
            batch_ratios.append(round(rate["spec"] / rate["off"], 3))
            batch_detail.append(detail)
            same &= outs["off"] == outs["spec"]
            if compiles.names:
                print(f"batch {b}: kernels compiled so far {compiles.names}", file=sys.stderr)
            so_far = {k: tokens[k] / seconds[k] for k in seconds}
            print(f"batch {b}: tok/s so far {so_far}", file=sys.stderr)
    if args.profile:
        _profile(engines, batches[0], params, args.profile)
    drafts = stats.num_drafts - drafts0
    draft_tokens = stats.num_draft_tokens - draft_tokens0
    accepted = stats.num_accepted_tokens - accepted0
    tps = {k: tokens[k] / seconds[k] for k in seconds}
    runner = engines["off"].engine.engine_core.executor.worker.model_runner
    report = {
        **report_head("spec_decode", args, runner),
        "batch_size": args.batch_size,
        "num_prompts": len(prompts),
        "kinds": sorted(set(kinds)),
        "max_tokens": args.max_tokens,
        "speculative": spec,
        # Triton kernels compiled inside the timed passes (a first-time cost in the figure; None:
        # this Triton cannot tell)
        "kernels_compiled_while_timed": compiles.names if compiles.supported else None,
        # (each with the pass that met it and the variant built: what the warm-up missed)
        "kernels_compiled_while_timed_detail": compiles.details if compiles.supported else None,
        "output_tokens": tokens,
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
        "tokens_per_s": {k: round(v, 2) for k, v in tps.items()},
        "speedup": round(tps["spec"] / tps["off"], 3),
        "speedup_by_batch": batch_ratios,
        # The median pass pair: one pass run slow by the host, on either engine, moves it less.
        "speedup_median_of_batches": round(float(np.median(batch_ratios)), 3),
        # Each batch's output tokens and seconds by engine: a batch whose outputs differ in
        # length (bf16 greedy outputs may part ways) pays its fixed costs over fewer tokens.
        "batches": batch_detail,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else 0.0,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 0.0,
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "greedy_outputs_identical": bool(same),
        "gc_tuned": True,
        "engine_steps": {name: dict(c) for name, c in steps.items()},  # (the timed passes')
        "graph_replays": {
            name: {k: v - replays0[name][k] for k, v in _graph_replays(llm).items()}
            for name, llm in engines.items()
        },
    }
    gov = engines["spec"].engine.engine_core.scheduler.spec_governor
    if gov is not None and not gov.fixed:  # what the speculation governor measured and chose
        report["governor"] = {
            "epochs": {"drafting": gov.epochs[True], "plain": gov.epochs[False]},
            "buckets": {
                f"{1 << (b - 1)}-{(1 << b) - 1}": {
                    "drafting_tok_s_per_request": round(st.rate.get(True, 0.0), 1),
                    "plain_tok_s_per_request": round(st.rate.get(False, 0.0), 1),
                    # drafting's slower requests' rate (the governor's floor), where measured
                    "drafting_floor_tok_s": None if st.floor is None else round(st.floor, 1),
                    "drafts": st.best,
                }
                for b, st in sorted(gov.buckets.items())
            },
            # Each epoch measured: its bucket's batch sizes, mode, rate, median step; counted:
            # false for one left out as disturbed (every step slowed).
            "history": [
                {
                    "batch": f"{1 << (b - 1)}-{(1 << b) - 1}",
                    "drafting": on,
                    "tok_s_per_request": round(rate, 1),
                    "median_step_ms": round(median * 1e3, 3),
                    "steps": n,
                    "tokens_per_forward": None if gain is None else round(gain, 3),
                    "counted": counted,
                }
                for b, on, rate, median, n, gain, counted in gov.history
            ],
        }
    # Why steps with draft slots went without drafts (each slot step waits for the step in
    # flight), and the cost model that decided.
    report["proposals"] = dict(proposals)  # (the timed passes': later passes add to the counts)
    report["draft_cost"] = _draft_cost(_proposer(engines["spec"]), args.batch_size)
    # What a step with draft slots that found no draft cost beyond a plain one (the runner's
    # measure, which pauses requests whose drafts do not pay for it).
    spec_runner = engines["spec"].engine.engine_core.executor.worker.model_runner
    report["slot_cost"] = spec_runner.spec.slot_cost.summary(args.batch_size)
    if args.plain_overhead:  # (after the report's counts: these passes are not in them)
        report["plain_overhead"] = _plain_overhead(engines, batches[0], params, args.plain_overhead)
        print(
            f"--- plain overhead\n{json.dumps(report['plain_overhead'], indent=1)}",
            file=sys.stderr,
        )
    if args.host_path:  # (after the report's counts: this pass is not in them)
        report["host_path"] = {k: _host_path(llm, batches[0], params) for k, llm in engines.items()}
        print(f"--- host path\n{json.dumps(report['host_path'], indent=1)}", file=sys.stderr)
    if args.timeline:
        report["timeline"] = _timeline(engines, batches[0], params)
    model, where = report_slugs(report, runner)
    which = "random" if random else args.prompts
    name = f"spec-decode-{args.method}-{model}-{which}-b{args.batch_size}-{where}"
    name += f"-{report['dtype'].removeprefix('torch.')}-{report['commit']}"
    path = save_report(report, name, args.output_json)
    keys = ("tokens_per_s", "speedup", "acceptance_rate", "mean_acceptance_length")
    print(json.dumps({k: report[k] for k in (*keys, "greedy_outputs_identical")}))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
