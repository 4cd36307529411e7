"""``pagoda bench embed``: embedding throughput (requests/s, tokens/s) of Pagoda against
sentence-transformers on the same model, weights and token ids, in the same run.

Both engines get the same random token ids (``--num-prompts`` of ``--input-len`` tokens):
Pagoda as ``LLM.embed`` prompts of token ids, sentence-transformers as its own forward over
batches of ``--st-batch-size`` (its ``encode`` minus tokenizing). The model is a folder (its
sentence-transformers files say how it pools) or, with ``--random-weights CONFIG_DIR``, random
weights built once from a config.json (a causal LM: last-token pooling, normalised, as
Qwen3-Embedding). The report says both rates, their ratio and the smallest cosine between the
two engines' embeddings of the same prompt. Each engine runs ``--repeats`` times (Pagoda on new
prompts each time: none is in its prefix cache); the rates are at the median run's time, and
each run's seconds are listed (``runs_s``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def add_embed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=256, help="requests (default 256)")
    p.add_argument("--input-len", type=int, default=512, help="tokens per prompt (default 512)")
    p.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch")
    p.add_argument(
        "--random-weights",
        metavar="CONFIG_DIR",
        default=None,
        help="a folder with a config.json: both engines run it on random weights, built once",
    )
    p.add_argument("--weights-seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs of each engine; the report's times are their medians (default 3)",
    )
    p.add_argument("--skip-st", action="store_true", help="measure Pagoda only")
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the timed run, one more under torch's profiler: the report gains where its "
        "time went (on a GPU: kernel time by kernel, the device's busy time and when it started)",
    )
    p.add_argument("--output-json", default=None, help="also write the report here")


def run_embed(args: argparse.Namespace, config: Any) -> int:
    """Run the benchmark of ``args`` with the engine configuration ``config``."""
    # NOTE: torch and the engine load when a benchmark runs, not when the CLI builds its parser.
    import numpy as np
    import torch

    from pagoda.attention import jit
    from pagoda.bench.random_weights import ensure_random_weights
    from pagoda.bench.report import commit, hardware, report_text
    from pagoda.engine.llm_engine import LLMEngine

    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: want at least 1")
    overrides: dict[str, Any] = {}
    weights = None
    if args.random_weights:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        folder, weights = ensure_random_weights(
            Path(args.random_weights), args.weights_seed, device
        )
        overrides["model"] = str(folder)
    if config.model.task == "auto":
        overrides["task"] = "embed"
    config = config.with_overrides(overrides) if overrides else config
    llm = LLMEngine(config)
    # An ``auto`` engine whose best backend's kernels were not built yet runs on another while
    # they compile in the background: the figure is the engine's once they are, so wait and
    # start again (the report names the backend the figure ran on; a compile still running
    # after the wait's 15 minutes leaves the figure on the backend the engine started on).
    if jit.wait_for_background_compiles(timeout=900):
        llm.shutdown()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        llm = LLMEngine(config)
    info = llm.info
    backend = _attention_backend(llm)
    gen = np.random.default_rng(0)
    low = 10 if info.shape.vocab_size > 100 else 0
    ids = gen.integers(low, info.shape.vocab_size, (args.num_prompts, args.input_len)).tolist()
    n_tokens = args.num_prompts * args.input_len

    # NOTE: the warm-up's own prompts: warming up on timed ones would leave them in the prefix
    # cache, a head start sentence-transformers does not get.
    # (a full step of them, so that the timed steps' shapes have run once)
    warm = max(8, min(args.num_prompts, info.max_num_batched_tokens // max(args.input_len, 1)))
    _embed(llm, gen.integers(low, info.shape.vocab_size, (warm, args.input_len)).tolist())
    # Each repeat embeds prompts of its own (new ones: none of them in the prefix cache); the
    # first repeat's embeddings are the ones compared with sentence-transformers'.
    runs = []
    shape = (args.num_prompts, args.input_len)
    watch = _clock_watch(info.device)
    with watch:
        for r in range(args.repeats):
            prompts = ids if r == 0 else gen.integers(low, info.shape.vocab_size, shape).tolist()
            start = time.perf_counter()
            out = _embed(llm, prompts)
            runs.append(time.perf_counter() - start)
            if r == 0:
                ours = out
    pagoda_s = statistics.median(runs)
    results: dict[str, Any] = {"pagoda": _rates(args.num_prompts, n_tokens, pagoda_s, runs)}
    # (a GPU at its power limit lowers its clock: the engines compare at the clocks they ran at)
    clocks = {"pagoda": watch.summary()}
    if args.profile:
        prompts = gen.integers(low, info.shape.vocab_size, (args.num_prompts, args.input_len))
        results["pagoda_profile"] = _profile(llm, prompts.tolist(), info.device)
    pooler = info.pooler
    if not args.skip_st:
        llm.shutdown()
        del llm
        if info.device.type == "cuda":
            torch.cuda.empty_cache()
        watch = _clock_watch(info.device)
        st_runs, theirs = _sentence_transformers(
            info.hf_dir, pooler, ids, args.st_batch_size, info.device, info.dtype, args.repeats,
            watch,
        )  # fmt: skip
        clocks["sentence_transformers"] = watch.summary()
        st_s = statistics.median(st_runs)
        results["sentence_transformers"] = _rates(args.num_prompts, n_tokens, st_s, st_runs)
        results["pagoda_over_sentence_transformers"] = round(st_s / pagoda_s, 3)
        cos = (ours * theirs).sum(1) / (
            np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1)
        )
        results["min_cosine"] = float(cos.min())
    report = {
        "benchmark": "embed",
        "model": info.name,
        "weights": weights,
        "dtype": str(info.dtype).replace("torch.", ""),
        "device": info.device.type,
        "hardware": hardware(info.device),
        "commit": commit(),
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len},
        "repeats": args.repeats,
        "pooling": None if pooler is None else pooler.pooling_type,
        # (``attention.backend: auto`` picks by priority and by what is compiled: the figure's)
        "attention_backend": backend,
        "results": results,
        # SM clock, power and throttling while each engine's timed runs ran (None: not a GPU,
        # or no nvidia-smi)
        "clocks": clocks,
    }
    text = report_text(report)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    return 0


def _clock_watch(device: Any) -> Any:
    """A :class:`~pagoda.bench.device.ClockWatch` of ``device`` (one that samples nothing on a
    CPU)."""
    from pagoda.bench.device import ClockWatch

    return ClockWatch(device.index or 0, enabled=device.type == "cuda")


def _attention_backend(engine: Any) -> str | None:
    """The attention backend the engine's model runs on, where the engine runs its worker in
    this process (None where it does not)."""
    try:
        return engine.engine_core.executor.worker.model_runner.attn_backend.name
    except AttributeError:
        return None


def _embed(engine: Any, ids: list[list[int]]) -> Any:
    """Embeddings of every prompt of token ids, as ``LLM.embed`` runs them (one pooling request
    each, added a step's worth at a time, the engine stepped until all are done)."""
    import numpy as np

    from pagoda.engine.admission import StepAdmission
    from pagoda.pooling_params import PoolingParams
    from pagoda.process import steps_gc

    # (resolved once, as ``LLM.embed`` does for a batch: a resolved PoolingParams is not
    # resolved again for each prompt)
    params = engine.resolve_pooling(PoolingParams(task="embed"))

    def add(i: int, rid: str) -> int:
        engine.add_pooling(rid, None, ids[i], params)
        return len(ids[i])

    admission = StepAdmission(engine, len(ids), add)
    done: dict[str, Any] = {}
    with steps_gc():  # (as ``LLM``'s calls run their steps)
        while len(done) < len(ids):
            admission.top_up()
            for out in engine.step():
                done[out.request_id] = out.outputs.data
    # (float32 already: no second copy of the batch)
    return np.stack([done[r] for r in admission.ids]).astype(np.float32, copy=False)


def _profile(
    engine: Any, ids: list[list[int]], device: Any, top: int = 12, gaps_top: int = 12
) -> dict[str, Any]:
    """One more embedding call (new prompts: no prefix-cache hits) under torch's profiler:
    its wall and the host's phases of each step (``host_phases``); on a GPU the device's busy
    time (kernels' union), its idle time between its first kernel and its last, when its first
    kernel started and its last ended (from the call's start), its ``gaps_top`` longest waits
    (``device_gaps``) and the ``top`` kernels by total time; on a CPU the ``top`` operators by
    their own time. All in ms."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from pagoda.bench.timeline import busy_and_gaps

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        with record_function("pagoda.bench.embed"), _host_phases(engine):
            _embed(engine, ids)
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.events()
    call = next(e for e in events if e.name == "pagoda.bench.embed")
    start = call.time_range.start
    out: dict[str, Any] = {"wall_ms": round((call.time_range.end - start) / 1e3, 2)}
    # The host's phases of each step, as [start, end] ms from the call's start, in order.
    ranges = sorted(
        (e.time_range.start, e.time_range.end, e.name[len(PHASE) :])
        for e in events
        if e.name.startswith(PHASE) and e.device_type == torch.autograd.DeviceType.CPU
    )
    out["host_phases"] = [
        [name, round((s - start) / 1e3, 2), round((e - start) / 1e3, 2)] for s, e, name in ranges
    ]
    if cuda:
        spans = sorted(
            (e.time_range.start, e.time_range.end, e.name)
            for e in events
            # NOTE: the call's own range (and the phases') are on the device's timeline too
            # (annotations): their spans are not work, and counted as such they made every
            # call look gapless.
            if e.device_type == torch.autograd.DeviceType.CUDA
            and e.name != "pagoda.bench.embed"
            and not e.name.startswith(PHASE)
        )
        busy, hi, between = busy_and_gaps(spans)
        gaps = [(b - a, a, name) for a, b, name in between]
        out.update(
            device_busy_ms=round(busy / 1e3, 2),
            device_idle_ms=round((hi - spans[0][0] - busy) / 1e3, 2),
            first_kernel_ms=round((spans[0][0] - start) / 1e3, 2),
            first_kernel=spans[0][2][:80],
            last_kernel_end_ms=round((hi - start) / 1e3, 2),
            # The longest times the device waited between two kernels (``at_ms``: when it
            # began waiting), with the kernel it waited for and what the host was doing then.
            device_gaps=[
                {
                    "at_ms": round((at - start) / 1e3, 2),
                    "ms": round(gap / 1e3, 3),
                    "next": name[:60],
                    "host": _phase_at(ranges, at),
                }
                for gap, at, name in sorted(gaps, reverse=True)[:gaps_top]
            ],
        )
        times = {a.key: a.self_device_time_total for a in prof.key_averages()}
    else:
        times = {a.key: a.self_cpu_time_total for a in prof.key_averages()}
    times.pop("pagoda.bench.embed", None)
    ranked = sorted(((t, k) for k, t in times.items() if t > 0), reverse=True)[:top]
    out["kernels" if cuda else "operators"] = [
        {"name": k[:120], "ms": round(t / 1e3, 3)} for t, k in ranked
    ]
    return out


# The profiled call's host phases are ranges named PHASE + the phase.
PHASE = "pagoda.bench.embed."


def _host_phases(engine: Any) -> Any:
    """Each step's phases on the host (the scheduler's ``schedule`` and ``after_launch``, the
    executor's ``launch``, reading a step's output) as profiler ranges, while the block runs;
    an engine whose core runs in another process has none."""
    from pagoda.bench.timeline import annotated

    core = engine.engine_core
    scheduler, executor = getattr(core, "scheduler", None), getattr(core, "executor", None)
    targets = [
        (scheduler, "schedule", "schedule"),
        (scheduler, "after_launch", "after_launch"),
        (executor, "launch", "launch"),
        (core, "_finish", "finish"),
    ]
    return annotated(targets, prefix=PHASE)


def _phase_at(ranges: list[tuple[int, int, str]], at: int) -> str | None:
    """The innermost host phase under way at ``at`` (the last begun of those spanning it)."""
    inside = [name for s, e, name in ranges if s <= at <= e]
    return inside[-1] if inside else None


def _rates(n: int, tokens: int, seconds: float, runs: list[float]) -> dict[str, Any]:
    """The rates at ``seconds`` (the median of ``runs``, each run's seconds)."""
    return {
        "elapsed_s": round(seconds, 3),
        "requests_per_s": round(n / seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "runs_s": [round(r, 4) for r in runs],
    }


def _sentence_transformers(
    folder: str,
    pooler: Any,
    ids: list[list[int]],
    batch: int,
    device: Any,
    dtype: Any,
    repeats: int = 1,
    watch: Any = None,
) -> tuple[list[float], Any]:
    """sentence-transformers' seconds over ``ids``, ``repeats`` times (its forward, batch by
    batch, after one warm-up batch; under ``watch`` where given), and its embeddings. A folder
    without its files gets the pipeline the engine pooled with (Transformer, Pooling of the
    same kind, Normalize when normalised)."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from pagoda.process import steps_gc

    if (Path(folder) / "modules.json").is_file():
        st = SentenceTransformer(folder, device=str(device))
    else:
        mode = {"LAST": "lasttoken", "CLS": "cls", "MEAN": "mean"}[pooler.pooling_type]
        body = Transformer(folder, model_kwargs={"dtype": dtype})
        mods = [body, Pooling(body.get_embedding_dimension(), pooling_mode=mode)]
        if pooler.normalize:
            mods.append(Normalize())
        st = SentenceTransformer(modules=mods, device=str(device))
    st = st.to(dtype).eval()
    tensor = torch.tensor(ids, device=device)

    def run(rows: torch.Tensor) -> torch.Tensor:
        feats = {"input_ids": rows, "attention_mask": torch.ones_like(rows)}
        return st(feats)["sentence_embedding"].float()

    runs = []
    with torch.inference_mode(), watch if watch is not None else contextlib.nullcontext():
        run(tensor[:batch])
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            with steps_gc():  # (the collector as Pagoda's timed calls have it)
                parts = [run(tensor[i : i + batch]) for i in range(0, len(ids), batch)]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            runs.append(time.perf_counter() - start)
    return runs, np.concatenate([p.cpu().numpy() for p in parts])
