"""The sampler's share of the model runner's step time, with a batch of decoding requests.

    .venv/bin/python benchmarks/sampler_share.py            # 64 requests, temperature only
    .venv/bin/python benchmarks/sampler_share.py --params '{"temperature": 0.8, "top_p": 0.9}'

Every runner step (``ModelRunner.execute_model``) is timed, and inside it the sampler's work:
building the step's sampling metadata, ``Sampler.forward``, and writing the sampled ids back. The
logits projection (lm_head) belongs to the model. The figure is taken over the steps where every
request decodes one token (the batch the figure is about); all steps are reported too. JSON goes
to benchmarks/results/ with the command, hardware and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagoda import LLM, SamplingParams
from pagoda.bench.report import commit, hardware, save_report
from pagoda.bench.throughput import make_prompts


def _timed(fn: Callable[..., Any], bucket: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket.append(time.perf_counter() - t0)

    return wrapper


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--params", default='{"temperature": 0.8}', help="SamplingParams as JSON")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    llm = LLM(max_num_seqs=args.batch, max_model_len=args.input_len + args.output_len + 1)
    runner = llm.engine.engine_core.executor.worker.model_runner
    ib = runner.input_batch
    sampler_parts: list[float] = []
    ib.sampling_metadata = _timed(ib.sampling_metadata, sampler_parts)
    ib.append_sampled = _timed(ib.append_sampled, sampler_parts)
    runner.sampler.forward = _timed(runner.sampler.forward, sampler_parts)
    steps: list[tuple[float, float, int, int]] = []  # step s, sampler s, tokens, sampled rows
    execute = runner.execute_model

    def execute_model(so: Any) -> Any:
        sampler_parts.clear()
        t0 = time.perf_counter()
        out = execute(so)
        sampled = sum(1 for t in out.sampled_token_ids if t)
        steps.append(
            (time.perf_counter() - t0, sum(sampler_parts), so.total_num_scheduled_tokens, sampled)
        )
        return out

    runner.execute_model = execute_model
    vocab = runner.shape.vocab_size
    prompts = make_prompts(args.batch, args.input_len, args.input_len, vocab, 0, set())
    params = SamplingParams(
        max_tokens=args.output_len, ignore_eos=True, seed=None, **json.loads(args.params)
    )
    llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)

    decode = [s for s in steps if s[2] == s[3] == args.batch]
    share = sum(s[1] for s in decode) / sum(s[0] for s in decode)
    report = {
        "benchmark": "sampler_share",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": llm.engine.info.name,
        "device": runner.device.type,
        "hardware": hardware(runner.device),
        "commit": commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": {
            "batch": args.batch,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "params": json.loads(args.params),
        },
        "results": {
            "decode_steps": len(decode),
            "decode_step_ms_median": round(1e3 * statistics.median(s[0] for s in decode), 2),
            "sampler_ms_median": round(1e3 * statistics.median(s[1] for s in decode), 2),
            "sampler_share_of_decode_steps": round(share, 4),
            "sampler_share_of_all_steps": round(
                sum(s[1] for s in steps) / sum(s[0] for s in steps), 4
            ),
        },
    }
    path = save_report(
        report,
        f"sampler-share-{report['model']}-{report['device']}-{report['commit']}",
        args.output_json,
    )
    r = report["results"]
    print(
        f"decode step {r['decode_step_ms_median']} ms, sampler {r['sampler_ms_median']} ms: "
        f"{100 * share:.2f}% of decode step time ({len(decode)} steps at batch {args.batch})"
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
