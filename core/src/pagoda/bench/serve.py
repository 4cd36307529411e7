"""``pagoda bench serve``: a workload at a given request rate against a running server.

Prompts are random windows of real text, tokenized by the server (``/tokenize``), so the input
length is exact for any model; each request streams ``/v1/completions`` with EOS ignored, so the
output length is exact too. Reports throughput and TTFT, TPOT, ITL and end-to-end latency
percentiles, printed and written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagoda.bench.report import commit, save_report

# Text to cut prompts from; any text works, its tokens only need to be real ones.
_CORPUS = (
    "The history of mathematics deals with the origin of discoveries in mathematics and the "
    "mathematical methods and notation of the past. Before the modern age and the worldwide "
    "spread of knowledge, written examples of new mathematical developments have come to light "
    "only in a few locales. From 3000 BC the Mesopotamian states of Sumer, Akkad and Assyria, "
    "followed closely by Ancient Egypt and the Levantine state of Ebla began using arithmetic, "
    "algebra and geometry for purposes of taxation, commerce, trade and also in the patterns in "
    "nature, the field of astronomy and to record time and formulate calendars. Rivers shape "
    "valleys over millions of years; glaciers carve them deeper still, leaving lakes behind. "
    "A good recipe balances salt, fat, acid and heat, and a patient cook tastes as she goes. "
)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's address")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="90,99", help="comma-separated percentiles")
    p.add_argument(
        "--output-json",
        default=None,
        help="where to write results (default: benchmarks/results/serve-*.json)",
    )
    p.add_argument("--no-save", action="store_true", help="print results only")


@dataclass
class _Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


async def _one(client: Any, url: str, body: dict[str, Any], headers: dict[str, str]) -> _Result:
    res = _Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = True
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values) * 1000.0
    out = {"mean_ms": float(arr.mean()), "median_ms": float(np.median(arr))}
    for p in percentiles:
        out[f"p{p:g}_ms"] = float(np.percentile(arr, p))
    return {k: round(v, 2) for k, v in out.items()}


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    # NOTE: httpx loads only where a client runs.
    import httpx

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(None, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # NOTE: the key goes with every call: the server asks for it on /version and /metrics too.
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        models = (await client.get(f"{base}/v1/models", headers=headers)).raise_for_status()
        model = args.model or models.json()["data"][0]["id"]
        version = (await client.get(f"{base}/version")).json()
        tok = await client.post(f"{base}/tokenize", json={"prompt": _CORPUS * 4}, headers=headers)
        corpus = tok.raise_for_status().json()["tokens"]
        rng = np.random.default_rng(args.seed)
        prompts = []
        for _ in range(args.num_prompts):
            start = int(rng.integers(0, len(corpus)))
            ids = (corpus[start:] + corpus * (args.input_len // len(corpus) + 1))[: args.input_len]
            prompts.append(ids)
        url = f"{base}/v1/completions"

        def body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
            return {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }

        warm = await _one(client, url, body(prompts[0][:16], 2), headers)
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        gaps = (
            np.zeros(args.num_prompts)
            if args.request_rate == float("inf")
            else rng.exponential(1.0 / args.request_rate, args.num_prompts)
        )
        limit = asyncio.Semaphore(args.max_concurrency or args.num_prompts)

        async def limited(prompt: list[int]) -> _Result:
            async with limit:
                return await _one(client, url, body(prompt, args.output_len), headers)

        spec_before = await _spec_counters(client, base)
        tasks = []
        t0 = time.perf_counter()
        for prompt, gap in zip(prompts, gaps):
            if gap:
                await asyncio.sleep(float(gap))
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        spec_after = await _spec_counters(client, base)
    report = _report(args, model, version, results, duration)
    report["speculative"] = _spec_figures(spec_before, spec_after)
    return report


_SPEC_SERIES = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


async def _spec_counters(client: Any, base: str) -> dict[str, float]:
    """The server's speculative decoding counters (``pagoda:spec_decode_*``); empty when it
    does not speculate."""
    resp = await client.get(f"{base}/metrics")
    out: dict[str, float] = {}
    if resp.status_code != 200:
        return out
    for line in resp.text.splitlines():
        for key in _SPEC_SERIES:
            if line.startswith(f"pagoda:spec_decode_{key}_total"):
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _spec_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """Acceptance over the run: rate and mean acceptance length, or None without drafts."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _SPEC_SERIES}
    if not d["num_drafts"]:
        return None
    return {
        "drafts": int(d["num_drafts"]),
        "draft_tokens": int(d["num_draft_tokens"]),
        "accepted_tokens": int(d["num_accepted_tokens"]),
        "acceptance_rate": round(d["num_accepted_tokens"] / d["num_draft_tokens"], 4),
        "mean_acceptance_length": round(1 + d["num_accepted_tokens"] / d["num_drafts"], 3),
    }


def _report(
    args: argparse.Namespace,
    model: str,
    version: dict[str, Any],
    results: list[_Result],
    duration: float,
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    pct = [float(x) for x in args.percentiles.split(",") if x.strip()]
    n_out = sum(r.output_tokens for r in done)
    n_in = args.input_len * len(done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "benchmark": "serve",
        "model": model,
        "server": {k: v for k, v in version.items() if k != "version"},
        "pagoda": version.get("version"),
        "commit": commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "pagoda " + " ".join(sys.argv[1:]),
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": str(args.request_rate),
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
        },
        "results": {
            "duration_s": round(duration, 3),
            "completed": len(done),
            "failed": len(results) - len(done),
            "errors": sorted({r.error for r in results if not r.ok})[:5],
            "input_tokens": n_in,
            "output_tokens": n_out,
            "request_throughput_per_s": round(len(done) / duration, 3),
            "output_tokens_per_s": round(n_out / duration, 2),
            "total_tokens_per_s": round((n_in + n_out) / duration, 2),
            "ttft": _stats([r.ttft for r in done], pct),
            "tpot": _stats(tpot, pct),
            "itl": _stats([x for r in done for x in r.itl], pct),
            "e2e_latency": _stats([r.latency for r in done], pct),
        },
    }


def run_bench_serve(args: argparse.Namespace) -> int:
    report = asyncio.run(_run(args))
    r = report["results"]
    print(f"completed {r['completed']}, failed {r['failed']} in {r['duration_s']} s")
    print(
        f"request throughput {r['request_throughput_per_s']} req/s, output "
        f"{r['output_tokens_per_s']} tok/s, total {r['total_tokens_per_s']} tok/s"
    )
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        figures = ", ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in r[name].items())
        print(f"{name:<12} ms: {figures}")
    for err in r["errors"]:
        print(f"error: {err}")
    if not args.no_save:
        device = report["server"].get("device", "unknown")
        path = save_report(
            report, f"serve-{report['model']}-{device}-{report['commit']}", args.output_json
        )
        print(f"results: {path}")
    return 0 if r["failed"] == 0 else 1
