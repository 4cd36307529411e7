"""The host's part of a batch-1 verification step: where a launch spends its time after it has
read the step in flight, before the device has anything to run.

With draft slots filled at launch (``pagoda.worker.draft_slots``) a launch waits for the step in
flight, then proposes from its tokens, builds the verification's inputs and replays its graph:
the device waits through everything after the read. This times each part of the launches that
waited and verified (``time.perf_counter_ns`` around the runner's functions; no profiler, whose
own cost would swamp them) and reports medians in microseconds, with ``read_to_replay``: from the
read's end to the graph's replay, the host's share of the step.

``benchmarks/eagle_host_time.py --method ngram --accept-all`` times the same functions, summed
over whole runs and compared across variants; this one times them per launch and finds the
window the device waits through.

The model is random SmolLM2-135M weights whose final norm is zero (``--all-accepted`` of
``benchmarks/spec_decode.py``): greedy output repeats one token, every draft is accepted, so
every step verifies. On a GPU: verification graphs are captured on CUDA only, so on a CPU no
launch qualifies (the report then counts none).

    python benchmarks/spec_host_path.py [--method ngram] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spec_decode as sd  # noqa: E402 (the benchmark's workload helpers)

from pagoda import SamplingParams  # noqa: E402
from pagoda.bench.report import commit, hardware  # noqa: E402


def _targets(llm: Any) -> list[tuple[Any, str, str]]:
    import pagoda.worker.draft_slots as draft_slots
    import pagoda.worker.model_runner as model_runner
    from pagoda.worker.step_output import StepOutput

    runner = llm.engine.engine_core.executor.worker.model_runner
    spec = runner.spec
    targets = [
        (runner, "launch", "launch"),
        (runner.in_flight, "read_all", "read_all"),
        (runner, "_update_states", "update_states"),
        (model_runner, "propose_for_slots", "propose_for_slots"),
        (draft_slots, "propose", "propose"),
        (spec.proposer, "propose", "proposer.propose"),
        (model_runner, "fill_draft_slots", "fill_draft_slots"),
        (model_runner, "run_verify_graph", "run_verify_graph"),
        (spec.buffers, "copy_inputs", "copy_inputs"),
        (spec.buffers, "uniform_step", "uniform_step"),
        (spec.verify_graphs, "run", "verify_graph"),
        (torch.cuda.CUDAGraph, "replay", "graph_replay"),
        (model_runner, "verify_drafts", "verify_drafts"),
        (StepOutput, "get", "read_step"),
    ]
    return [t for t in targets if hasattr(t[0], t[1])]


def measure(llm: Any, prompts: list[dict], params: SamplingParams) -> dict[str, Any]:
    from pagoda.bench.timeline import timed

    log: list[tuple[str, int, int]] = []
    with timed(_targets(llm), lambda label, a, b: log.append((label, a, b))):
        llm.generate(prompts, params, use_tqdm=False)
    parts: dict[str, list[float]] = collections.defaultdict(list)
    launches = [(a, b) for label, a, b in log if label == "launch"]
    for s, e in launches:
        inside = [(label, a, b) for label, a, b in log if s <= a and b <= e and label != "launch"]
        names = {label for label, _, _ in inside}
        if not {"read_all", "run_verify_graph", "graph_replay"} <= names:
            continue  # (only launches that waited for the step in flight and verified)
        read_end = max(b for label, _, b in inside if label == "read_all")
        replay = min(a for label, a, _ in inside if label == "graph_replay" and a >= read_end)
        parts["read_to_replay"].append((replay - read_end) / 1e3)
        parts["launch"].append((e - s) / 1e3)
        sums: dict[str, float] = collections.defaultdict(float)
        for label, a, b in inside:
            sums[label] += (b - a) / 1e3
        for label, us in sums.items():
            parts[label].append(us)
    n = len(parts.get("launch", []))
    return {
        "launches": len(launches),
        "waited_verifying_launches": n,
        "median_us": {k: round(float(np.median(v)), 1) for k, v in parts.items()},
        # (a part missing from some launches: its median over those that had it)
        "share_of_launches": {k: round(len(v) / max(n, 1), 2) for k, v in parts.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="ngram")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    here = Path(__file__).resolve().parent
    ns = argparse.Namespace(
        model=None, random_weights=str(here / "configs" / "smollm2-135m"), all_accepted=True,
        device="cuda" if cuda else "cpu", dtype=args.dtype, prompts="random",
        num_prompts=args.num_prompts, kinds=None, input_len=256, max_tokens=args.max_tokens,
        max_model_len=2048, batch_size=1,
        kv_cache_memory_bytes=int(torch.cuda.mem_get_info()[0] * 0.25) if cuda else None,
    )  # fmt: skip
    sd.use_random_weights(ns)
    llm = sd._build(ns, {"method": args.method})
    prompts, _ = sd.workload_prompts(ns, llm)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # (warm-up)
    report = {
        "benchmark": "spec_host_path",
        "command": "python benchmarks/spec_host_path.py " + " ".join(sys.argv[1:]),
        "hardware": hardware(torch.device("cuda" if cuda else "cpu")),
        "commit": commit(),
        "method": args.method,
        "dtype": args.dtype,
        **measure(llm, prompts, params),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")


if __name__ == "__main__":
    main()
