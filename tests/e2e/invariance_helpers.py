"""Shared by the CPU and GPU batch-invariance tests: one request, seeded or greedy, run alone, in
mixed batches of several sizes, and as the first sample of n = 4, on an engine built by the caller
(chunked prefill on or off); every run's tokens and logprobs, to be compared bit for bit."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from pagoda import LLM, SamplingParams

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"

# What each run gives back: the tokens, and per token the logprob of every token listed.
Run = tuple[list[int], list[dict[int, float]]]


def write_config(folder: Path, base: str, **changes: object) -> Path:
    """``benchmarks/configs/<base>/config.json`` with ``changes``, written to ``folder``."""
    cfg = json.loads((CONFIGS / base / "config.json").read_text())
    cfg.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _run(out) -> Run:  # noqa: ANN001 (a CompletionOutput)
    lps = [{t: lp.logprob for t, lp in pos.items()} for pos in out.logprobs]
    return list(out.token_ids), lps


def target_params(max_tokens: int) -> dict[str, SamplingParams]:
    return {
        "seeded": SamplingParams(
            max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=7, logprobs=3, ignore_eos=True
        ),
        "greedy": SamplingParams(
            max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True
        ),
    }


def runs_of_one_request(
    llm: LLM,
    prompt: list[int],
    others: list[list[int]],
    batch_sizes: tuple[int, ...],
    max_tokens: int,
) -> dict[str, Run]:
    """``{"<kind> <how>": run}`` for kind seeded and greedy, how: alone, ``batch N`` (the request
    last after N - 1 others, which sample at random and stop at different lengths) and ``n=4``
    (the first sample; seeded only, as greedy samples are all alike)."""
    runs: dict[str, Run] = {}
    for kind, sp in target_params(max_tokens).items():
        runs[f"{kind} alone"] = _run(llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0])
        for size in batch_sizes:
            mates = [others[i % len(others)] for i in range(size - 1)]
            params = [
                SamplingParams(max_tokens=2 + (3 * i) % max_tokens, temperature=0.8, top_k=50)
                for i in range(size - 1)
            ]
            outs = llm.generate([{"prompt_token_ids": p} for p in [*mates, prompt]], [*params, sp])
            runs[f"{kind} batch {size}"] = _run(outs[-1].outputs[0])
        if kind == "seeded":
            n4 = SamplingParams(
                n=4, max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=7, logprobs=3,
                ignore_eos=True,
            )  # fmt: skip
            runs[f"{kind} n=4"] = _run(llm.generate({"prompt_token_ids": prompt}, n4)[0].outputs[0])
    return runs


def differences(runs: dict[str, Run], reference: dict[str, Run] | None = None) -> list[str]:
    """Each run whose tokens or logprobs differ from its kind's run alone (in ``reference`` if
    given, else in ``runs``), named with the first position that differs."""
    reference = reference or runs
    bad = []
    for name, (tokens, lps) in runs.items():
        kind = name.split()[0]
        ref_tokens, ref_lps = reference[f"{kind} alone"]
        if tokens != ref_tokens:
            i = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), -1)
            bad.append(f"{name}: token {i} is {tokens[i]}, alone {ref_tokens[i]}")
        elif lps != ref_lps:
            i = next(i for i, (a, b) in enumerate(zip(lps, ref_lps)) if a != b)
            bad.append(f"{name}: logprobs at token {i} are {lps[i]}, alone {ref_lps[i]}")
    return bad


def check_invariance(
    make_llm: Callable[[bool], LLM],
    prompt: list[int],
    others: list[list[int]],
    batch_sizes: tuple[int, ...],
    max_tokens: int,
) -> list[str]:
    """Differences of every run, chunked prefill on and off, from the request alone unchunked."""
    reference: dict[str, Run] | None = None
    bad: list[str] = []
    for chunked in (False, True):
        llm = make_llm(chunked)
        runs = runs_of_one_request(llm, prompt, others, batch_sizes, max_tokens)
        del llm
        reference = reference or runs
        bad += [f"chunked={chunked} {d}" for d in differences(runs, reference)]
    return bad
