"""Images in, text out on one GPU: a Qwen2.5-VL-3B-shaped model with random weights (bfloat16),
Pagoda's native Qwen2.5-VL (pagoda-models-vision) against transformers' own generate; one JSON.

    python benchmarks/multimodal.py \
        --output-json benchmarks/results/multimodal-qwen2.5-vl-3b-<gpu>-<commit>.json

- ``throughput``: 64 requests, each one 448x448 image (256 image tokens) between a few text
  tokens, 128 greedy output tokens each (EOS ignored). Pagoda takes all 64 at once
  (``LLM.generate``); transformers runs ``generate`` on batches of ``--hf-batch`` (the prompts
  are of one length: no padding). Both start from PIL images (the image processor's time
  counts); each engine in a process of its own, one after the other.
- ``encoder_cache``: on Pagoda, 64 requests of which 16 share one image (each prompt's text
  differs before the image, so the prefix cache cannot stand in for the encoder): the encoder
  cache's hit rate (15 of 64 lookups is the most), and the front end's processed-image cache.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagoda.bench.random_weights import config_folder
from pagoda.bench.report import commit

CONFIG = Path(__file__).parent / "configs" / "qwen2.5-vl-3b"
NUM_REQUESTS = 64
SHARED = 16
IMAGE_SIDE = 448
OUTPUT_TOKENS = 128
TEXT_TOKENS = 24



def _images(num: int, seed: int, shared: int = 0) -> list:
    """``num`` random RGB images of IMAGE_SIDE squared; the first ``shared`` are one image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    side = (IMAGE_SIDE, IMAGE_SIDE, 3)
    first = Image.fromarray(rng.integers(0, 256, side, dtype=np.uint8))
    out = [first] * max(shared, 1)
    while len(out) < num:
        out.append(Image.fromarray(rng.integers(0, 256, side, dtype=np.uint8)))
    return out[:num]


def _prompts(cfg: dict, num: int) -> list[list[int]]:
    """Token ids: TEXT_TOKENS words (distinct per request), then the image's placeholder between
    vision start and end, then a few more words."""
    start, pad, end = (cfg["vision_start_token_id"], cfg["image_token_id"],
                       cfg["vision_end_token_id"])  # fmt: skip
    return [[1000 + 37 * i + k for k in range(TEXT_TOKENS)] + [start, pad, end, 500, 501, 502]
            for i in range(num)]  # fmt: skip


def run_pagoda(folder: Path) -> dict:
    import torch

    from pagoda import LLM, SamplingParams

    cfg = json.loads((folder / "config.json").read_text())
    llm = LLM(model=str(folder), load_format="dummy", dtype="bfloat16", max_model_len=2048)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    scheduler = llm.engine.engine_core.scheduler
    cache = scheduler.encoder_cache
    processor = llm.engine.input_processor.mm_processor

    def run(images: list) -> tuple[float, int, int]:
        prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": im}}
                   for ids, im in zip(_prompts(cfg, len(images)), images)]  # fmt: skip
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        return seconds, out_tokens, prompt_tokens

    run(_images(4, seed=99))  # warm-up: kernels, graphs, the processor's first call
    seconds, out_tokens, prompt_tokens = run(_images(NUM_REQUESTS, seed=1))
    throughput = {
        "requests": NUM_REQUESTS,
        "seconds": round(seconds, 3),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_per_s": round(out_tokens / seconds, 1),
        "total_tokens_per_s": round((out_tokens + prompt_tokens) / seconds, 1),
    }
    queries, hits = cache.queries, cache.hits
    p_queries, p_hits = processor.cache.queries, processor.cache.hits
    seconds, out_tokens, _ = run(_images(NUM_REQUESTS, seed=2, shared=SHARED))
    lookups, found = cache.queries - queries, cache.hits - hits
    encoder_cache = {
        "requests": NUM_REQUESTS,
        "sharing_one_image": SHARED,
        "encoder_cache_lookups": lookups,
        "encoder_cache_hits": found,
        "encoder_cache_hit_rate": round(found / lookups, 4) if lookups else None,
        "best_possible_hit_rate": round((SHARED - 1) / NUM_REQUESTS, 4),
        "processor_cache_hit_rate": round(
            (processor.cache.hits - p_hits) / max(processor.cache.queries - p_queries, 1), 4
        ),
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(out_tokens / seconds, 1),
    }
    return {"throughput": throughput, "encoder_cache": encoder_cache,
            "gpu": torch.cuda.get_device_name()}  # fmt: skip


def run_transformers(folder: Path, batch: int) -> dict:
    import numpy as np
    import torch
    import transformers as tf
    from pagoda_models_vision.processor import Qwen2_5_VLProcessor

    cfg = json.loads((folder / "config.json").read_text())
    hf_cfg = tf.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device("cuda"):  # random weights drawn on the GPU, not the host
        model = tf.Qwen2_5_VLForConditionalGeneration._from_config(
            hf_cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    proc = Qwen2_5_VLProcessor(cfg, None)
    gen = dict(max_new_tokens=OUTPUT_TOKENS, min_new_tokens=OUTPUT_TOKENS, do_sample=False,
               eos_token_id=None, pad_token_id=0)  # fmt: skip

    def run(images: list) -> tuple[float, int, int]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out_tokens = prompt_tokens = 0
        prompts = _prompts(cfg, len(images))
        for b in range(0, len(images), batch):
            ids, pixels, grids = [], [], []
            for p, im in zip(prompts[b : b + batch], images[b : b + batch]):
                expanded, mm = proc.process(p, [im])
                ids.append(expanded)
                pixels.append(mm.features[0].data["pixel_values"])
                grids.append(mm.features[0].data["image_grid_thw"])
            input_ids = torch.tensor(ids, device="cuda")
            with torch.no_grad():
                seqs = model.generate(
                    input_ids,
                    pixel_values=torch.from_numpy(np.concatenate(pixels)).to("cuda"),
                    image_grid_thw=torch.from_numpy(np.concatenate(grids)).to("cuda"),
                    mm_token_type_ids=(input_ids == cfg["image_token_id"]).int(),
                    **gen,
                )
            out_tokens += (seqs.shape[1] - input_ids.shape[1]) * seqs.shape[0]
            prompt_tokens += input_ids.numel()
        torch.cuda.synchronize()
        return time.perf_counter() - start, out_tokens, prompt_tokens

    run(_images(min(batch, 4), seed=99))  # warm-up
    seconds, out_tokens, prompt_tokens = run(_images(NUM_REQUESTS, seed=1))
    return {
        "throughput": {
            "requests": NUM_REQUESTS,
            "batch": batch,
            "seconds": round(seconds, 3),
            "output_tokens": out_tokens,
            "prompt_tokens": prompt_tokens,
            "output_tokens_per_s": round(out_tokens / seconds, 1),
            "total_tokens_per_s": round((out_tokens + prompt_tokens) / seconds, 1),
        },
        "gpu": torch.cuda.get_device_name(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json", type=Path)
    ap.add_argument("--hf-batch", type=int, default=64,
                    help="transformers' generate batch (lower it if it runs out of memory)")
    ap.add_argument("--cases", nargs="+", default=["transformers", "pagoda"],
                    choices=["transformers", "pagoda"])  # fmt: skip
    ap.add_argument("--one", choices=["transformers", "pagoda"], help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a child: one engine in this process
        if args.one == "pagoda":
            result = run_pagoda(args.folder)
        else:
            result = run_transformers(args.folder, args.hf_batch)
        args.result.write_text(json.dumps(result))
        return 0
    if args.output_json is None:
        ap.error("--output-json is required")
    report: dict = {
        "benchmark": "multimodal",
        "command": " ".join(["python benchmarks/multimodal.py", *sys.argv[1:]]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "model": "qwen2.5-vl-3b (random weights, bfloat16)",
        "workload": {"requests": NUM_REQUESTS, "image": f"{IMAGE_SIDE}x{IMAGE_SIDE}",
                     "output_tokens": OUTPUT_TOKENS, "text_tokens": TEXT_TOKENS + 3},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = config_folder(CONFIG, Path(tmp))
        for case in args.cases:
            out = Path(tmp) / f"{case}.json"
            cmd = [sys.executable, __file__, "--one", case, "--folder", str(folder),
                   "--result", str(out), "--hf-batch", str(args.hf_batch)]  # fmt: skip
            print(f"multimodal benchmark: {case}", flush=True)
            subprocess.run(cmd, check=True)
            report[case] = json.loads(out.read_text())
    tps = {c: report[c]["throughput"]["output_tokens_per_s"] for c in args.cases}
    if len(tps) == 2:
        report["pagoda_over_transformers"] = round(tps["pagoda"] / tps["transformers"], 3)
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    summary = {
        "output_tokens_per_s": tps,
        "pagoda_over_transformers": report.get("pagoda_over_transformers"),
        "encoder_cache_hit_rate": report.get("pagoda", {}).get("encoder_cache", {}).get(
            "encoder_cache_hit_rate"
        ),
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
