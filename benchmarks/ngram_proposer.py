"""Host time of one n-gram proposal (``pagoda_spec_ngram.proposer.ngram_drafts``) for a batch.

The histories are the prompts of ``spec_decode.py``'s workload (``workload_prompts``: the
input-grounded one, chat-templated, or random ones with ``--random-weights``), each cut at a
random length past its half and tiled over the batch;
every request gets drafts each step, so this is what the runner's host pays per step while it
drafts. ``--against COMMIT`` times that commit's proposer on the same batches, alternating with
this one, and checks that both draft the same tokens.

    python benchmarks/ngram_proposer.py [--batch-sizes 1,64,256] [--against COMMIT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
from pagoda_spec_ngram.proposer import ngram_drafts
from spec_decode import add_workload_arguments, engine_args, use_random_weights, workload_prompts

from pagoda import LLM
from pagoda.bench.report import commit, hardware, save_report

_PROPOSER = "plugins/spec_decode/ngram/src/pagoda_spec_ngram/proposer.py"


def _at(rev: str) -> types.ModuleType:
    """The proposer module as it was at ``rev``."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{rev}:{_PROPOSER}"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(f"ngram_proposer_{rev}")
    exec(compile(source, f"{rev}:{_PROPOSER}", "exec"), module.__dict__)  # noqa: S102
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(p, max_tokens=0)
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--settings", default="4:2:4,8:1:8", help="k:min:max, comma-separated")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--against", default=None, metavar="COMMIT")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    use_random_weights(args)
    prompts = [p["prompt_token_ids"] for p in workload_prompts(args, LLM(**engine_args(args)))[0]]
    impls = {"this": ngram_drafts}
    if args.against:
        impls[args.against] = _at(args.against).ngram_drafts
    rng = np.random.default_rng(0)
    rows = []
    for n in (int(b) for b in args.batch_sizes.split(",")):
        width = max(len(h) for h in prompts) + 1
        ids = np.full((n, width), -1, dtype=np.int64)
        num = np.zeros(n, dtype=np.int64)
        for i in range(n):
            h = prompts[i % len(prompts)]
            num[i] = rng.integers(len(h) // 2, len(h) + 1)
            ids[i, : num[i]] = h[: num[i]]
        for setting in args.settings.split(","):
            k, lo, hi = (int(x) for x in setting.split(":"))
            call = (ids, np.arange(n), num, lo, hi, k)
            drafts = {name: f(*call) for name, f in impls.items()}
            same = all((d == drafts["this"]).all() for d in drafts.values())
            seconds = dict.fromkeys(impls, 0.0)
            for _ in range(args.repeats):  # alternating, so that a busy machine slows both
                for name, f in impls.items():
                    start = time.perf_counter()
                    f(*call)
                    seconds[name] += time.perf_counter() - start
            ms = {name: round(s / args.repeats * 1e3, 3) for name, s in seconds.items()}
            rows.append({"batch_size": n, "setting": setting, "ms": ms, "same_drafts": same})
            print(f"batch {n:4d} {setting:>7}: " + ", ".join(f"{a} {b} ms" for a, b in ms.items()))
    report = {
        "benchmark": "ngram_proposer",
        "command": "python " + " ".join(sys.argv),
        "hardware": hardware(torch.device("cpu")),
        "commit": commit(),
        "rows": rows,
    }
    name = f"ngram-proposer-cpu-{report['commit']}"
    if args.against:
        name += f"-vs-{args.against}"
    print(json.dumps({"results": str(save_report(report, name, args.output_json))}))


if __name__ == "__main__":
    main()
