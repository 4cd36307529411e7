"""The suffix proposer's host time per call, split as a batch-1 step on a GPU meets it:
``propose`` (between reading the step in flight and launching the next: the device waits) and
``settle`` (after the launch: hidden behind the device's step while it is shorter).

A synthetic copy task: each request's prompt is 600 random tokens, its output a 400-token span
of the prompt with one token in 37 changed; each call accepts the drafts that match the output
and one token more, as greedy verification does. Requests run one after another, so from the
second on the global tree holds the earlier outputs.

    OMP_NUM_THREADS=1 python benchmarks/suffix_proposer.py [--requests 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch
from pagoda_spec_suffix.proposer import SuffixProposer

from pagoda.bench.report import commit, hardware, save_report
from pagoda.config import SpeculativeConfig
from pagoda.spec_decode import ProposalBatch
from pagoda.testing.spec_decode import make_context

VOCAB, WIDTH = 1000, 2048


def run(requests: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ctx = make_context(SpeculativeConfig(method="suffix"), max_num_reqs=1)
    ctx = dataclasses.replace(ctx, vocab_size=VOCAB, max_model_len=WIDTH - 1)
    proposer = SuffixProposer(ctx)
    token_ids = np.full((1, WIDTH), -1, dtype=np.int64)
    propose_s, settle_s, gained, first_s, remove_s = [], [], [], [], []
    for r in range(requests):
        prompt = rng.integers(0, VOCAB, 600).tolist()
        out = prompt[100:500]
        for j in range(0, len(out), 37):
            out[j] = int(rng.integers(0, VOCAB))
        history = list(prompt)
        token_ids[0] = -1
        token_ids[0, : len(history)] = history
        done, first = 0, True
        while done < len(out):
            batch = ProposalBatch(
                req_ids=[f"r{r}"], rows=np.array([0]), token_ids=token_ids,
                num_tokens=np.array([len(history)]), num_prompt_tokens=np.array([len(prompt)]),
                max_num_drafts=np.array([8]),
            )  # fmt: skip
            t0 = time.perf_counter()
            drafts = proposer.propose(batch)
            t1 = time.perf_counter()
            proposer.settle()
            t2 = time.perf_counter()
            if first:  # (the prompt's tokens: a request's first call)
                first_s.append(t1 - t0)
                first = False
            else:
                propose_s.append(t1 - t0)
                settle_s.append(t2 - t1)
            row = [t for t in drafts.token_ids[0].tolist() if t >= 0]
            accepted = 0
            while accepted < len(row) and done + accepted < len(out):
                if row[accepted] != out[done + accepted]:
                    break
                accepted += 1
            new = out[done : done + accepted + 1]
            token_ids[0, len(history) : len(history) + len(new)] = new
            history += new
            done += len(new)
            gained.append(len(new))
        t0 = time.perf_counter()
        proposer.remove([f"r{r}"])
        remove_s.append(time.perf_counter() - t0)
    us = lambda xs, f: round(f(xs) * 1e6, 1)  # noqa: E731
    return {
        "calls": len(propose_s),
        "tokens_per_call": round(statistics.fmean(gained), 2),
        "propose_us_median": us(propose_s, statistics.median),
        "propose_us_mean": us(propose_s, statistics.fmean),
        "settle_us_median": us(settle_s, statistics.median),
        "settle_us_mean": us(settle_s, statistics.fmean),
        "first_call_ms_median": round(statistics.median(first_s) * 1e3, 2),
        # (a request leaving: its output joins the global tree, at once or in later settles)
        "remove_ms_median": round(statistics.median(remove_s) * 1e3, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="runs; the one of median propose time")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    runs = sorted((run(args.requests) for _ in range(args.repeats)),
                  key=lambda r: r["propose_us_median"])  # fmt: skip
    result = runs[len(runs) // 2]
    report = {
        "benchmark": "suffix_proposer",
        "command": "python benchmarks/suffix_proposer.py",
        "hardware": hardware(torch.device("cpu")),
        "commit": commit(),
        "requests": args.requests,
        **result,
    }
    path = save_report(report, "suffix-proposer-cpu", args.output_json)
    for k, v in result.items():
        print(f"{k:>22}: {v}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
