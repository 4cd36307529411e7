"""N-gram speculation settings for a workload, chosen from one generation without speculation.

Generates the greedy outputs of the workload of ``spec_decode.py`` once, then replays the
n-gram proposer over them for each setting (``pagoda_spec_ngram.replay``: under greedy decoding
what a verification step accepts is fixed by the output, so the replay takes exactly the steps an
engine drafting on every step takes at batch 1). For each setting: output tokens per engine step
(after the prompt's), the steps with drafts, acceptance rate and mean acceptance length, overall
and by kind of prompt. The speed-up to expect at batch 1 is tokens per step times the ratio of a
plain decode step's time to a speculative step's (on a GPU at batch 1, where the host or the
weights' reads bound a step, that ratio changes little with k). The outputs are generated in one
batch; a batch-1 engine's may differ at near-ties.

    python benchmarks/ngram_settings.py [--num-prompts 9] [--max-tokens 256] \\
        [--settings 4:2:4,8:1:8]      # num_speculative_tokens:prompt_lookup_min:prompt_lookup_max
"""

from __future__ import annotations

import argparse
import json
import time

from pagoda_spec_ngram.replay import Replay, replay
from spec_decode import (
    add_workload_arguments,
    engine_args,
    report_head,
    report_slugs,
    use_random_weights,
    workload_prompts,
)

from pagoda import LLM, SamplingParams
from pagoda.bench.report import save_report

_SETTINGS = "4:2:4,4:1:4,8:2:4,8:1:4,8:1:8,12:1:8,16:1:8"


def _figures(r: Replay) -> dict:
    return {
        "tokens_per_step": round(r.tokens_per_step, 3),
        "steps": r.steps,
        "verifications": r.verifications,
        "acceptance_rate": round(r.accepted_tokens / r.draft_tokens, 4) if r.draft_tokens else 0.0,
        "mean_acceptance_length": round(r.mean_acceptance_length, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(p, max_tokens=256)
    p.add_argument("--settings", default=_SETTINGS, help="k:min:max, comma-separated")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    settings = [tuple(int(x) for x in s.split(":")) for s in args.settings.split(",")]
    use_random_weights(args)
    llm = LLM(**engine_args(args))
    prompts, kinds = workload_prompts(args, llm)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, ignore_eos=bool(args.random_weights)
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    generated_s = time.perf_counter() - start
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    rows = []
    for k, lo, hi in settings:
        total, by_kind = Replay(), {kind: Replay() for kind in kinds}
        for prompt, output, kind in zip(prompts, outputs, kinds):
            r = replay(prompt["prompt_token_ids"], output, k, lo, hi, args.max_tokens)
            total += r
            by_kind[kind] += r
        rows.append(
            {
                "num_speculative_tokens": k,
                "prompt_lookup_min": lo,
                "prompt_lookup_max": hi,
                **_figures(total),
                "by_kind": {kind: _figures(r) for kind, r in sorted(by_kind.items())},
            }
        )
    runner = llm.engine.engine_core.executor.worker.model_runner
    report = {
        **report_head("ngram_settings", args, runner),
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "output_tokens": sum(len(o) for o in outputs),
        "generated_s": round(generated_s, 2),
        "settings": rows,
    }
    model, where = report_slugs(report, runner)
    name = f"ngram-settings-{model}-{where}-{report['commit']}"
    path = save_report(report, name, args.output_json)
    print(f"{'k:min:max':>10} {'tok/step':>8} {'steps':>6} {'verif':>6} {'acc':>6} {'len':>6}")
    for row in rows:
        s = f"{row['num_speculative_tokens']}:{row['prompt_lookup_min']}:{row['prompt_lookup_max']}"
        print(
            f"{s:>10} {row['tokens_per_step']:8.3f} {row['steps']:6d} {row['verifications']:6d} "
            f"{row['acceptance_rate']:6.3f} {row['mean_acceptance_length']:6.2f}"
        )
    print(json.dumps({"results": str(path)}))


if __name__ == "__main__":
    main()
