"""EAGLE-3 at batch 1: tokens/s without speculation, with a trained head and with a random one,
and the trained head's mean acceptance length, on held-out prompts (the training command's
corpus, texts it does not train on, past those its own evaluation used).

    python benchmarks/eagle.py --model MODEL --head HEAD_DIR OUT_DIR

The three engines live in one process; each prompt runs on each engine in turn (rotating the
order), so a machine shared with other work slows all alike; the figures are ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from pagoda_spec_eagle.checkpoint import llama_head_config, random_head_weights, write_head
from pagoda_spec_eagle.record import corpus, encode_prompts

from pagoda import LLM, SamplingParams
from pagoda.bench.report import commit, hardware, save_report
from pagoda.config import SpeculativeConfig
from pagoda.process import tuned_gc


def _random_head(trained: str, out: Path) -> str:
    cfg = json.loads((Path(trained) / "config.json").read_text())
    rnd = llama_head_config(
        "eagle3", cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
        cfg["num_key_value_heads"], cfg["vocab_size"], head_dim=cfg["head_dim"],
        draft_vocab_size=cfg["draft_vocab_size"],
    )  # fmt: skip
    write_head(out, rnd, random_head_weights(rnd, seed=1))
    return str(out)


def _profile(engines: dict, prompt: list[int], params: SamplingParams, out_dir: Path) -> None:
    """The host's time per function for one prompt on each engine (the steps' shape: engine
    steps, proposer calls, launches)."""
    import cProfile
    import io
    import pstats

    for name, llm in engines.items():
        prof = cProfile.Profile()
        prof.enable()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
        stats.print_stats(40)
        stats.sort_stats("cumulative").print_stats("pagoda", 60)
        (out_dir / f"eagle3-b1-profile-{name}.txt").write_text(text.getvalue())


def _runner(llm: LLM):
    return llm.engine.engine_core.executor.worker.model_runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--model", required=True)
    p.add_argument("--head", required=True, help="a trained EAGLE-3 head folder")
    p.add_argument(
        "--heldout-skip", type=int, default=16, help="held-out prompts the training evaluated on"
    )
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--attention-backend",
        default=None,
        help="attention.backend for every engine (default: auto); with triton a verification "
        "is launched before the step in flight is read (pagoda.worker.drafts_ahead)",
    )
    p.add_argument("--training-json", default=None, help="the training command's figures")
    p.add_argument(
        "--governor",
        action="store_true",
        help="also both heads with the engine's speculation governor on (speculative.adaptive, "
        "the default: drafting only while it pays), as a user runs them",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also write a host profile (cProfile) of one prompt per engine to OUT_DIR",
    )
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "max_num_seqs": 4,
        "kv_cache_memory_bytes": 1 << 30 if device.type == "cuda" else 64 << 20,
        "enable_prefix_caching": False,
    }
    if args.attention_backend:
        base["attention_backend"] = args.attention_backend
    k = args.num_speculative_tokens
    random_dir = _random_head(args.head, Path(tempfile.mkdtemp(prefix="eagle3-random-head-")))
    spec = {"method": "eagle3", "num_speculative_tokens": k}
    if "adaptive" in SpeculativeConfig.model_fields:  # measure the drafts, not a governor
        spec["adaptive"] = False
    engines = {
        "none": LLM(**base),
        "eagle3": LLM(**base, speculative_config={**spec, "model": args.head}),
        "eagle3_random": LLM(**base, speculative_config={**spec, "model": random_dir}),
    }
    if args.governor:
        governed = {key: value for key, value in spec.items() if key != "adaptive"}
        engines["eagle3_governed"] = LLM(
            **base, speculative_config={**governed, "model": args.head}
        )
        engines["eagle3_random_governed"] = LLM(
            **base, speculative_config={**governed, "model": random_dir}
        )
    drafting = [name for name in engines if name != "none"]
    messages = corpus(args.num_prompts, args.seed, heldout=True, skip=args.heldout_skip)
    room = args.max_model_len - args.max_tokens - k - 8
    prompts = [p[-room:] for p in encode_prompts(engines["none"], messages)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for llm in engines.values():  # warm-up
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    for llm in engines.values():
        st = llm.engine.engine_core.scheduler
        st.spec_stats_total = type(st.spec_stats_total)()
    seconds = dict.fromkeys(engines, 0.0)
    tokens = dict.fromkeys(engines, 0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    names = list(engines)
    with tuned_gc():  # as the engine-core process runs (pagoda.process)
        for i, prompt in enumerate(prompts):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                llm = engines[name]
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
                seconds[name] += time.perf_counter() - t0
                tokens[name] += len(out.outputs[0].token_ids)
                outputs[name].append(list(out.outputs[0].token_ids))
    tps = {name: tokens[name] / seconds[name] for name in engines}
    report = {
        "benchmark": "eagle3-batch1",
        "gc_tuned": True,
        "commit": commit(),
        "hardware": hardware(device),
        "model": Path(args.model).name,
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": k,
        "tokens_per_s": tps,
        "speedup_trained": tps["eagle3"] / tps["none"],
        "speedup_random": tps["eagle3_random"] / tps["none"],
        "speculative_config": spec,
        "attention_backend": args.attention_backend or "auto",
        "greedy_identical": {name: outputs[name] == outputs["none"] for name in drafting},
    }
    if args.governor:
        report["speedup_trained_governed"] = tps["eagle3_governed"] / tps["none"]
        report["speedup_random_governed"] = tps["eagle3_random_governed"] / tps["none"]
    for name in drafting:
        st = engines[name].engine.engine_core.scheduler.spec_stats_total
        report[name] = {
            "mean_acceptance_length": st.mean_acceptance_length,
            "acceptance_rate": st.acceptance_rate,
            "acceptance_per_position": [
                a / st.num_drafts if st.num_drafts else 0.0 for a in st.accepted_per_pos
            ],
            "num_drafts": st.num_drafts,
            "verifications_launched_ahead": _runner(engines[name]).spec.ahead_launches,
        }
    if args.profile:  # after the figures: the profile's steps count in no statistic
        _profile(engines, prompts[0], params, out_dir)
    if args.training_json and Path(args.training_json).exists():
        report["training"] = json.loads(Path(args.training_json).read_text())
    path = save_report(
        report,
        "",
        str(out_dir / f"eagle3-b1-{Path(args.model).stem.lower()}-{device.type}-{commit()}.json"),
    )
    keys = ("tokens_per_s", "speedup_trained", "speedup_random", "speedup_trained_governed",
            "speedup_random_governed", "greedy_identical")  # fmt: skip
    print(json.dumps({key: report[key] for key in keys if key in report}))
    print("trained head:", json.dumps(report["eagle3"]))
    print("wrote", path)
    del engines
    gc.collect()


if __name__ == "__main__":
    main()
