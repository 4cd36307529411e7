"""Host time of the output processor for a batch of decoding requests, building every
request's ``RequestOutput`` each step (what a streaming caller reads) and only finished ones
(requests added ``final_only``, as ``LLM.generate`` and non-streaming server requests are).

The requests (tiny random model's tokenizer, 16-token prompts) each get one token a step for
``--output-len`` steps, then finish; the figure is milliseconds a step, best of ``--repeats``,
both modes in turns.

    python benchmarks/output_processor_host.py [--requests 256] [--output-len 512]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pagoda.bench.random_weights import ensure_random_weights
from pagoda.bench.report import commit, hardware, save_report
from pagoda.engine.output_processor import OutputProcessor
from pagoda.loader import load_tokenizer
from pagoda.sampling_params import SamplingParams
from pagoda.step import EngineCoreOutput

CONFIG = Path(__file__).parent / "configs" / "tiny-llama"


def _time(tokenizer, requests: int, steps: int, final_only: bool) -> float:
    """Milliseconds a step of ``process_outputs``."""
    proc = OutputProcessor(tokenizer)
    rng = np.random.default_rng(0)
    vocab = min(tokenizer.vocab_size, 1000)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        prompt = rng.integers(10, vocab, 16).tolist()
        proc.add_request(f"r{i}", None, prompt, [(f"r{i}", params)], final_only)
    tokens = rng.integers(10, vocab, (steps, requests)).tolist()
    seconds, built = 0.0, 0
    for s in range(steps):
        last = s == steps - 1
        outs = [
            EngineCoreOutput(f"r{i}", [tokens[s][i]], "length" if last else None)
            for i in range(requests)
        ]
        t0 = time.perf_counter()
        results, _ = proc.process_outputs(outs)
        seconds += time.perf_counter() - t0
        built += len(results)
    assert built == (requests if final_only else requests * steps)
    return seconds / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    folder, _ = ensure_random_weights(CONFIG, 0, torch.device("cpu"))
    tokenizer = load_tokenizer(folder)
    best = {"every_step": float("inf"), "final_only": float("inf")}
    for _ in range(args.repeats):
        for mode in best:
            ms = _time(tokenizer, args.requests, args.output_len, mode == "final_only")
            best[mode] = min(best[mode], ms)
    rows = {f"ms_a_step_{k}": round(v, 3) for k, v in best.items()}
    print(json.dumps(rows))
    report = {
        "benchmark": "output_processor_host",
        "command": "python " + " ".join(sys.argv),
        "hardware": hardware(torch.device("cpu")),
        "commit": commit(),
        "requests": args.requests,
        "output_len": args.output_len,
        **rows,
    }
    name = f"output-processor-host-r{args.requests}-o{args.output_len}-cpu-{report['commit']}"
    print(json.dumps({"results": str(save_report(report, name, args.output_json))}))


if __name__ == "__main__":
    main()
