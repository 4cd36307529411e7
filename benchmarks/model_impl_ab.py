"""Two model impls on one workload, alternating, one engine per process: output tokens/s and
start-up of each, and their ratio, in one JSON.

    python benchmarks/model_impl_ab.py --impls native transformers --rounds 2 \
        --output-json benchmarks/results/model-impls-nano-qwen3-0.6b-<gpu>-<commit>.json \
        -- --workload nano --attention-backend triton

Arguments after ``--`` go to ``pagoda bench throughput`` unchanged (``--peers none`` is added).
Each round runs every impl once, in turn, so drift of a shared machine falls on both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(impl: str, bench_args: list[str], out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "throughput", "--peers", "none",
        "--model-impl", impl, "--output-json", str(out), *bench_args,
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    report = json.loads(out.read_text())
    pagoda = report["results"]["pagoda"]
    return {
        "output_tokens_per_s": pagoda["output_tokens_per_s"],
        "startup": report["startup"],
        "commit": report["commit"],
        "hardware": report["hardware"],
        "engine_config": report["engine_config"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", nargs=2, default=["native", "transformers"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output-json", type=Path, required=True)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    runs: dict[str, list[dict]] = {impl: [] for impl in args.impls}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for impl in args.impls:
                runs[impl].append(_run(impl, bench_args, Path(tmp) / f"{impl}-{r}.json"))
    base, other = args.impls
    tps = {i: [x["output_tokens_per_s"] for x in runs[i]] for i in args.impls}
    report = {
        "benchmark": "model_impl_ab",
        "command": " ".join(["python benchmarks/model_impl_ab.py", *sys.argv[1:]]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": runs[base][0]["commit"],
        "hardware": runs[base][0]["hardware"],
        "output_tokens_per_s": tps,
        "median_output_tokens_per_s": {i: statistics.median(v) for i, v in tps.items()},
        f"{other}_over_{base}": round(
            statistics.median(tps[other]) / statistics.median(tps[base]), 3
        ),
        "startup": {i: [x["startup"] for x in runs[i]] for i in args.impls},
        "engine_config": {i: runs[i][0]["engine_config"] for i in args.impls},
    }
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps({k: report[k] for k in ("median_output_tokens_per_s", f"{other}_over_{base}")})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
