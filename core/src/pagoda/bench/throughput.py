"""``pagoda bench throughput``: offline generation speed, Pagoda and transformers in one run.

Both engines get the same random prompts (token ids) and produce a fixed number of greedy tokens
each (EOS ignored), so the work is identical; the figure is output tokens per second of
generation, model loading excluded. The ratio of the two is what to compare across machines.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from pagoda.bench.report import commit, hardware, save_report


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-input-len", type=int, default=32)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="transformers batch size (default: all prompts in one batch)",
    )
    p.add_argument("--skip-hf", action="store_true", help="measure Pagoda only")
    p.add_argument(
        "--output-json",
        default=None,
        help="where to write results (default: benchmarks/results/throughput-*.json "
        "under the current directory)",
    )


def make_prompts(
    n: int, lo: int, hi: int, vocab: int, seed: int, avoid: set[int]
) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.array([t for t in range(vocab) if t not in avoid])
    lens = rng.integers(lo, hi + 1, size=n)
    return [rng.choice(allowed, size=int(k)).tolist() for k in lens]


def _bench_pagoda(
    overrides: dict[str, Any], config: str | None, prompts: list[list[int]], output_len: int
) -> tuple[dict[str, Any], Any]:
    from pagoda import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(config=config, **overrides)
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(
        [{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False
    )  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return _figures(elapsed, n_out, prompts, load_s), llm


def _bench_hf(
    hf_dir: str,
    dtype: Any,
    device: Any,
    prompts: list[list[int]],
    output_len: int,
    pad_id: int,
    batch_size: int,
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    load_s = time.perf_counter() - t0
    n_out = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding, as generate wants for decoder-only models
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                pad_token_id=pad_id,
            )
        n_out += (out.shape[1] - width) * len(batch)
    elapsed = time.perf_counter() - t0
    return _figures(elapsed, n_out, prompts, load_s)


def _figures(elapsed: float, n_out: int, prompts: list[list[int]], load_s: float) -> dict[str, Any]:
    n_in = sum(map(len, prompts))
    return {
        "elapsed_s": round(elapsed, 3),
        "load_s": round(load_s, 3),
        "output_tokens": n_out,
        "output_tokens_per_s": round(n_out / elapsed, 2),
        "total_tokens_per_s": round((n_out + n_in) / elapsed, 2),
    }


def run_throughput(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    import torch

    pagoda, llm = None, None
    tok_probe_vocab = None
    from pagoda.config import EngineConfig
    from pagoda.engine.model_info import ModelInfo

    config = EngineConfig.load(args.config, overrides)
    info = ModelInfo.from_config(config)
    tok_probe_vocab = info.arch.vocab_size
    from pagoda.loader import load_tokenizer

    tokenizer = load_tokenizer(info.tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    prompts = make_prompts(
        args.num_prompts,
        args.min_input_len,
        args.max_input_len,
        min(tok_probe_vocab, len(tokenizer)),
        args.dataset_seed,
        special,
    )
    pagoda, llm = _bench_pagoda(overrides, args.config, prompts, args.output_len)
    results: dict[str, Any] = {"pagoda": pagoda}
    del llm
    if not args.skip_hf:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        results["transformers"] = _bench_hf(
            info.hf_dir,
            info.dtype,
            info.device,
            prompts,
            args.output_len,
            pad,
            args.hf_batch_size or len(prompts),
        )
        results["pagoda_over_transformers"] = round(
            pagoda["output_tokens_per_s"] / results["transformers"]["output_tokens_per_s"], 3
        )
    report = {
        "benchmark": "throughput",
        "model": info.name,
        "dtype": str(info.dtype).replace("torch.", ""),
        "device": info.device.type,
        "hardware": hardware(info.device),
        "commit": commit(),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": [args.min_input_len, args.max_input_len],
            "output_len": args.output_len,
            "dataset_seed": args.dataset_seed,
        },
        "results": results,
    }
    path = save_report(
        report, f"throughput-{info.name}-{info.device.type}-{report['commit']}", args.output_json
    )
    print(f"{'engine':<14}{'output tok/s':>14}{'elapsed s':>12}")
    for name in ("pagoda", "transformers"):
        if name in results:
            r = results[name]
            print(f"{name:<14}{r['output_tokens_per_s']:>14.1f}{r['elapsed_s']:>12.1f}")
    if "pagoda_over_transformers" in results:
        print(f"pagoda / transformers = {results['pagoda_over_transformers']:.2f}")
    print(f"results: {path}")
    return 0
