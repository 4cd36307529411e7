"""Settings of one embedding engine, judged as the issue's figure is: ``LLM.embed`` walls of
each, interleaved (A B B A ..., or A B C C B A ... for more than two), on new prompts each
call, after the board reached its steady state (on an H200 at this workload, its power limit:
a variant that is faster alone by drawing more power gains less here, and one that moves fewer
bytes may gain more than it saves alone).

A setting is a module attribute the engine reads at each call, set to each of two or more
Python literals (``True``/``False`` by default)::

    python benchmarks/embed_ab.py --toggle pagoda.ops:RESIDUAL_IN_EPILOGUE
    python benchmarks/embed_ab.py --toggle pagoda.ops.triton_gated_gemm:LAUNCH \\
        --values "(128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 4, 8), (128, 128, 128, 8, 2, 8)"

or several attributes set together (``--toggle`` again; each value a tuple, an attribute's value
an item)::

    python benchmarks/embed_ab.py --call llm \\
        --toggle pagoda.ops.triton_qkv_norm_rotary:LAUNCH \\
        --toggle pagoda.ops.triton_qkv_norm_rotary:HEADS_PER_PROGRAM \\
        --toggle pagoda.ops.triton_qkv_norm_rotary:PERSISTENT \\
        --values "((128, 64, 16, 3, 8), 2, True), ((128, 64, 8, 2, 4), 1, False)"

``--call llm`` times ``LLM.embed`` (with its outputs, as the issue's GPU test times it) instead
of the engine's steps as ``pagoda bench embed`` runs them.

It prints each setting's median wall and its ratio to the first's (above 1 when the first is
faster), and saves them with the clocks seen (``nvidia-smi``, where there is one) to
``benchmarks/results/`` (or ``--output-json``). On a CPU it runs too (``--device cpu``, a small
``--config``), which the tests use.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _setting(spec: str) -> tuple[object, str]:
    module, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise SystemExit(f"--toggle takes module:attribute, not {spec!r}")
    mod = importlib.import_module(module)
    if not hasattr(mod, attr):
        raise SystemExit(f"--toggle: {module} has no attribute {attr!r}")
    return mod, attr


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--toggle",
        required=True,
        action="append",
        help="module:attribute the engine reads per call (again: set together, a tuple a value)",
    )
    p.add_argument(
        "--values", default="True, False", help="the settings: two or more Python literals"
    )
    p.add_argument("--config", default=str(HERE / "configs" / "qwen3-0.6b"))
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--attention-backend", default=None, help="default: the engine's choice")
    p.add_argument("--device", default=None, help="default: cuda where there is one")
    p.add_argument(
        "--call",
        choices=("loop", "llm"),
        default="loop",
        help="what is timed: the engine's steps as `pagoda bench embed` runs them (loop), or "
        "LLM.embed with its outputs, as the issue's GPU test times it (llm)",
    )
    p.add_argument("--reps", type=int, default=10, help="calls of each setting")
    p.add_argument("--warm-s", type=float, default=2.0, help="seconds of calls before timing")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)

    import numpy as np
    import torch

    from pagoda import LLM
    from pagoda.bench.device import ClockWatch
    from pagoda.bench.embed import _embed
    from pagoda.bench.random_weights import ensure_random_weights
    from pagoda.bench.report import commit, hardware, save_report, slug

    try:
        values = list(ast.literal_eval(args.values))
    except (ValueError, SyntaxError, TypeError):
        values = []
    if len(values) < 2:
        raise SystemExit(f"--values takes two or more Python literals, not {args.values!r}")
    if args.reps < 1:
        raise SystemExit("--reps must be at least 1")
    settings = [_setting(spec) for spec in args.toggle]
    if len(settings) > 1:
        bad = [v for v in values if not (isinstance(v, tuple) and len(v) == len(settings))]
        if bad:
            raise SystemExit(
                f"--values: with {len(settings)} --toggle each value is a tuple of "
                f"{len(settings)}, not {bad[0]!r}"
            )
    else:
        values = [(v,) for v in values]
    attrs = [attr for _, attr in settings]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    folder, _ = ensure_random_weights(Path(args.config), 0, device)
    engine_args: dict = dict(task="embed", max_model_len=args.max_model_len)
    if args.attention_backend:
        engine_args["attention"] = {"backend": args.attention_backend}
    if device.type == "cpu":
        engine_args["device"] = "cpu"
    llm = LLM(model=str(folder), **engine_args)
    engine = llm.engine
    rng = np.random.default_rng(0)
    vocab = 1000 if device.type == "cpu" else 150_000

    def prompts(n: int = args.num_prompts) -> list[list[int]]:
        # New prompts every call: no prefix-cache hits.
        return rng.integers(10, vocab, (n, args.input_len)).tolist()

    def batch(ids: list[list[int]]) -> list:
        # (LLM.embed's prompts built before the clock starts)
        return [{"prompt_token_ids": x} for x in ids] if args.call == "llm" else ids

    def embed(prompts: list) -> None:
        if args.call == "llm":
            llm.embed(prompts, use_tqdm=False)
        else:
            _embed(engine, prompts)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def apply(value: tuple) -> None:
        for (mod, attr), v in zip(settings, value):
            setattr(mod, attr, v)

    before = tuple(getattr(mod, attr) for mod, attr in settings)
    names = [", ".join(f"{a}={v!r}" for a, v in zip(attrs, value)) for value in values]
    walls: dict[str, list[float]] = {n: [] for n in names}
    try:
        for v in values:  # each setting's kernels compiled before anything is timed
            apply(v)
            embed(batch(prompts(min(args.num_prompts, 64))))
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.warm_s:
            embed(batch(prompts()))
        with ClockWatch(device.index or 0, enabled=device.type == "cuda") as watch:
            for i in range(args.reps):
                order = list(zip(names, values))
                for name, v in order if i % 2 == 0 else order[::-1]:
                    apply(v)
                    ids = batch(prompts())
                    sync()
                    t = time.perf_counter()
                    embed(ids)
                    sync()
                    walls[name].append(time.perf_counter() - t)
    finally:
        apply(before)
    medians = {n: statistics.median(w) for n, w in walls.items()}
    first = medians[names[0]]
    report = {
        "benchmark": "embed_ab",
        "toggle": args.toggle[0] if len(args.toggle) == 1 else args.toggle,
        "call": args.call,
        "config": Path(args.config).name,
        "device": str(device),
        "hardware": hardware(device),
        "commit": commit(),
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len},
        "attention_backend": args.attention_backend,
        "reps": args.reps,
        "runs_s": {n: [round(x, 5) for x in w] for n, w in walls.items()},
        "median_s": {n: round(m, 5) for n, m in medians.items()},
        # each setting's median over the first's
        "over_first": {n: round(m / first, 4) for n, m in medians.items()},
        "clocks": watch.summary(),
    }
    for n in names:
        runs = [round(x * 1e3, 1) for x in walls[n]]
        ratio = report["over_first"][n]
        print(f"{n}: median {medians[n] * 1e3:.1f} ms ({ratio} of the first's), runs {runs}")
    board = slug(report["hardware"]) if device.type == "cuda" else "cpu"
    name = f"embed-ab-{slug('-'.join(attrs))}-{board}-{report['commit']}"
    print(f"saved {save_report(report, name, args.output_json)}")
    llm.engine.shutdown()
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
