"""The README's first command on a CPU, against transformers doing the same in a script.

Each round runs, one after the other as fresh processes (interleaved, so that a busy machine
slows both sides alike):

- ``pagoda generate "What is the capital of France?"`` (the default model, default settings);
- a script that loads the same weights with transformers (``AutoModelForCausalLM``, float32),
  applies the chat template and generates the same answer greedily (128 new tokens at most);
- ``pagoda generate`` with six prompts.

Each process's wall time and peak resident memory (its own ``wait4`` usage, so one process's peak
is not another's) are recorded; the report gives medians and the ratios the acceptance asks for:
Pagoda's wall time over transformers', six prompts over one, and Pagoda's peak memory.

``--threads default,1`` repeats every round with torch's default threads and with
``OMP_NUM_THREADS=1`` for every process: on a shared, oversubscribed machine, threads that wait on
each other make small-batch CPU work several times slower, and both sides alike.

    .venv/bin/python benchmarks/cli_first_minutes.py --rounds 3 --threads default,1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagoda.bench.report import commit, hardware, save_report, versions

QUESTION = "What is the capital of France?"
# Six questions of the README's kind, each answered in 8 tokens: the same work per prompt, sent
# as one batch. (A batch lasts as long as its longest answer; one of 128 tokens would time that
# answer's decode, not the batching.)
SIX = [
    QUESTION,
    "What is the capital of Germany?",
    "What is the capital of Japan?",
    "What is the capital of England?",
    "What is the capital of China?",
    "What is the capital of Egypt?",
]
PEER = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = sys.argv[1]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
ids = tok.apply_chat_template(
    [{"role": "user", "content": sys.argv[2]}], add_generation_prompt=True, return_tensors="pt"
)
ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
with torch.inference_mode():
    out = model.generate(ids, max_new_tokens=128, do_sample=False)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
"""


def timed(cmd: list[str], threads: str) -> dict[str, Any]:
    """Run ``cmd`` and wait for it with ``wait4``: wall time, peak RSS (bytes) and stdout."""
    env = os.environ.copy()
    if threads != "default":
        env["OMP_NUM_THREADS"] = threads
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({proc.returncode}):\n{err[-2000:]}")
    return {"wall_s": round(wall, 3), "peak_rss_bytes": usage.ru_maxrss * 1024, "stdout": out}


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians, and the per-round ratios of processes run next to each other."""

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[name])

    one, peer, six = runs["pagoda_one"], runs["transformers_one"], runs["pagoda_six"]
    ratios_wall = [p["wall_s"] / t["wall_s"] for p, t in zip(one, peer)]
    ratios_six = [s["wall_s"] / p["wall_s"] for s, p in zip(six, one)]
    mib = 2**20
    return {
        "pagoda_one_wall_s": med("pagoda_one", "wall_s"),
        "transformers_one_wall_s": med("transformers_one", "wall_s"),
        "pagoda_six_wall_s": med("pagoda_six", "wall_s"),
        "pagoda_one_peak_rss_mib": round(med("pagoda_one", "peak_rss_bytes") / mib, 1),
        "pagoda_one_max_peak_rss_mib": round(max(x["peak_rss_bytes"] for x in one) / mib, 1),
        "transformers_one_peak_rss_mib": round(med("transformers_one", "peak_rss_bytes") / mib, 1),
        "pagoda_six_peak_rss_mib": round(med("pagoda_six", "peak_rss_bytes") / mib, 1),
        "wall_ratio_pagoda_over_transformers": round(statistics.median(ratios_wall), 3),
        "wall_ratio_pagoda_over_transformers_per_round": [round(x, 3) for x in ratios_wall],
        "wall_ratio_six_over_one": round(statistics.median(ratios_six), 3),
        "wall_ratio_six_over_one_per_round": [round(x, 3) for x in ratios_six],
        "same_answer": one[0]["stdout"].strip() == peer[0]["stdout"].strip(),
        "answers": {k: v[0]["stdout"].strip() for k, v in runs.items()},
        "runs": {
            k: [{kk: vv for kk, vv in x.items() if kk != "stdout"} for x in v]
            for k, v in runs.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", default="default", help="comma-separated: default, or a thread count"
    )
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    from pagoda.loader import convert_gguf, default_model_path

    folder = convert_gguf(default_model_path())  # setup's work: done once, not timed
    load_start = os.getloadavg()
    pagoda = [str(Path(sys.executable).with_name("pagoda")), "generate"]
    commands = {
        "pagoda_one": [*pagoda, QUESTION],
        "transformers_one": [sys.executable, "-c", PEER, str(folder), QUESTION],
        "pagoda_six": [*pagoda, *SIX],
    }
    settings = args.threads.split(",")
    runs = {t: {k: [] for k in commands} for t in settings}
    for r in range(args.rounds):
        for t in settings:
            for name, cmd in commands.items():
                result = timed(cmd, t)
                runs[t][name].append(result)
                print(
                    f"round {r + 1} threads={t:7s} {name:17s} {result['wall_s']:6.2f} s "
                    f"{result['peak_rss_bytes'] / 2**20:7.0f} MiB",
                    flush=True,
                )
    summaries = {t: summarise(runs[t]) for t in settings}
    import torch

    report = {
        "benchmark": "cli_first_minutes",
        "command": " ".join(["python", "benchmarks/cli_first_minutes.py", *sys.argv[1:]]),
        "commands": {
            "pagoda_one": f"pagoda generate {QUESTION!r}",
            "transformers_one": f"python -c PEER (in this file) {folder} {QUESTION!r}",
            "pagoda_six": "pagoda generate " + " ".join(repr(p) for p in SIX),
        },
        "hardware": hardware(torch.device("cpu")),
        "load_average_at_end": os.getloadavg(),
        "commit": commit(),
        "versions": versions(),
        "rounds": args.rounds,
        "load_average_at_start": load_start,
        "by_threads": summaries,
    }
    path = save_report(report, f"cli-first-minutes-cpu-{commit()}", args.output_json)
    for t, summary in summaries.items():
        print(f"threads={t}")
        for key, value in summary.items():
            if key not in ("runs", "answers"):
                print(f"  {key:47s} {value}")
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
