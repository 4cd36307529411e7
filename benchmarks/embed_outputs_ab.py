"""``LLM.embed`` walls with its outputs made as before ``b903ed8`` (every embedding a list of
Python floats as its request finished, every prompt's ids copied) and as now (the engine's array
kept, the list made when first read; prompt lists taken as given), interleaved in one engine
(A B B A ...), each call on new prompts, after two seconds of calls::

    python benchmarks/embed_outputs_ab.py --output-json OUT.json

On a CPU it runs a tiny model (``--config``, ``--num-prompts``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(HERE / "configs" / "qwen3-0.6b"))
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--reps", type=int, default=10, help="calls of each way")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)

    import numpy as np
    import torch

    import pagoda.entrypoints.llm as llm_module
    from pagoda import LLM
    from pagoda.bench.random_weights import ensure_random_weights
    from pagoda.bench.report import commit, hardware, save_report, slug
    from pagoda.engine import input_processor
    from pagoda.outputs import EmbeddingOutput, EmbeddingRequestOutput

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    folder, _ = ensure_random_weights(Path(args.config), 0, device)
    # (the GPU test's engine)
    extra = {"gpu_memory_utilization": 0.5} if cuda else {"dtype": "float32"}
    llm = LLM(model=str(folder), task="embed", max_model_len=2048, **extra)
    vocab = min(150_000, llm.engine.info.shape.vocab_size)

    now_output = llm_module._embedding_output
    now_ids = input_processor.InputProcessor.process_ids

    def eager_output(o):  # as before: the list made as the request finished
        data = EmbeddingOutput(o.outputs.data.tolist())
        return EmbeddingRequestOutput(o.request_id, data, o.prompt_token_ids)

    def copied_ids(self, prompt):  # as before: every prompt's ids copied
        ids = list(prompt["prompt_token_ids"])
        return input_processor.ProcessedPrompt(prompt.get("prompt"), ids)

    def use(before: bool) -> None:
        llm_module._embedding_output = eager_output if before else now_output
        input_processor.InputProcessor.process_ids = copied_ids if before else now_ids

    rng = np.random.default_rng(0)

    def prompts() -> list[dict]:
        ids = rng.integers(10, vocab, (args.num_prompts, args.input_len)).tolist()
        return [{"prompt_token_ids": x} for x in ids]

    walls: dict[str, list[float]] = {"before": [], "now": []}
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            llm.embed(prompts(), use_tqdm=False)
        for i in range(args.reps):
            for way in ("before", "now") if i % 2 == 0 else ("now", "before"):
                use(way == "before")
                batch = prompts()
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                outs = llm.embed(batch, use_tqdm=False)  # (the last call's outputs freed here)
                walls[way].append(time.perf_counter() - start)
                del outs
    finally:
        use(False)
    medians = {k: statistics.median(v) for k, v in walls.items()}
    report = {
        "benchmark": "embed_outputs_ab",
        "config": Path(args.config).name,
        "device": str(device),
        "hardware": hardware(device),
        "commit": commit(),
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len},
        "reps": args.reps,
        "runs_s": {k: [round(x, 5) for x in v] for k, v in walls.items()},
        "median_s": {k: round(m, 5) for k, m in medians.items()},
        "before_over_now": round(medians["before"] / medians["now"], 4),
    }
    for k, v in walls.items():
        print(f"{k}: median {medians[k] * 1e3:.1f} ms, runs {[round(x * 1e3, 1) for x in v]}")
    print(f"before / now: {report['before_over_now']}")
    board = slug(report["hardware"]) if cuda else "cpu"
    name = f"embed-outputs-ab-{board}-{report['commit']}"
    print(f"saved {save_report(report, name, args.output_json)}")
    llm.engine.shutdown()
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
