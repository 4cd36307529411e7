"""Host time of the KV cache manager's ``allocate_slots`` for a batch of decoding requests.

Every running request asks for its next slot each step, so at batch 256 this is 256 calls a
step on the host that schedules; most fall within the blocks the request already holds. The
requests (300-token prompts, computed) decode ``--steps`` tokens each; the figure is the best
of ``--repeats`` runs, in microseconds a call, with the prefix cache on and off. ``--against
COMMIT`` times that commit's manager in turns with this one on the same requests.

    python benchmarks/kv_manager_host.py [--batch-size 256] [--steps 128] [--against COMMIT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from pagoda.bench.report import commit, hardware, save_report
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

_MANAGER = "core/src/pagoda/kv_cache/manager.py"


def _at(rev: str) -> type:
    """``KVCacheManager`` as it was at ``rev``."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{rev}:{_MANAGER}"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(f"kv_manager_{rev}")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(source, f"{rev}:{_MANAGER}", "exec"), module.__dict__)  # noqa: S102
    return module.KVCacheManager


def _time(cls: type, batch: int, steps: int, caching: bool) -> float:
    """Microseconds a call over ``steps`` decode steps of ``batch`` requests."""
    kv = cls(num_blocks=batch * 64, block_size=16, enable_caching=caching, max_model_len=2048)
    reqs = [
        Request(f"r{i}", list(range(i, i + 300)), SamplingParams(max_tokens=steps))
        for i in range(batch)
    ]
    for r in reqs:
        kv.allocate_slots(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
    seconds = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        for r in reqs:
            if kv.allocate_slots(r, 1) is None:
                raise RuntimeError("out of blocks: raise num_blocks")
        seconds += time.perf_counter() - t0
        for r in reqs:
            r.num_computed_tokens += 1
            r.output_token_ids.append(7)
    return seconds / (steps * batch) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--against", default=None, metavar="COMMIT")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    impls = {"this": KVCacheManager}
    if args.against:
        impls[args.against] = _at(args.against)
    rows = []
    for caching in (True, False):
        best = {name: float("inf") for name in impls}
        for _ in range(args.repeats):  # in turns: a host that slows down slows each alike
            for name, cls in impls.items():
                best[name] = min(best[name], _time(cls, args.batch_size, args.steps, caching))
        times = {f"us_a_call_{k}": round(v, 3) for k, v in best.items()}
        row = {"prefix_caching": caching, **times}
        rows.append(row)
        print(json.dumps(row))
    report = {
        "benchmark": "kv_manager_host",
        "command": "python " + " ".join(sys.argv),
        "hardware": hardware(torch.device("cpu")),
        "commit": commit(),
        "batch_size": args.batch_size,
        "steps": args.steps,
        "rows": rows,
    }
    name = f"kv-manager-host-cpu-{report['commit']}"
    if args.against:
        name += f"-vs-{args.against}"
    print(json.dumps({"results": str(save_report(report, name, args.output_json))}))


if __name__ == "__main__":
    main()
