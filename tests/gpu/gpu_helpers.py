"""Shared by the GPU tests: a random-weight Qwen3 folder, and near-tie checks on bf16 logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from pagoda import LLM, SamplingParams

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"


def save_random_qwen3(folder: Path) -> Path:
    """Qwen3-0.6B's shape (``benchmarks/configs``) on random bf16 weights (seed 0), with a
    synthetic tokenizer, saved in ``folder`` for transformers and Pagoda alike."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagoda.loader.synthetic import synthetic_tokenizer

    cfg = json.loads((CONFIGS / "qwen3-0.6b" / "config.json").read_text())
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    synthetic_tokenizer(cfg["vocab_size"], cfg["eos_token_id"]).save_pretrained(folder)
    return folder


#: Two logits within this many bf16 steps (8 bits of mantissa) of the top one's magnitude are a
#: tie that summation order decides.
BF16_STEPS = 2


def near_tie(logits: torch.Tensor) -> bool:
    top2 = logits.float().topk(2).values
    top, gap = float(top2[0]), float(top2[0] - top2[1])
    return gap <= BF16_STEPS * 2.0 ** (math.floor(math.log2(abs(top) or 1e-30)) - 7)


def near_tie_between(logits: torch.Tensor, a: int, b: int, steps: int = BF16_STEPS) -> bool:
    """Whether tokens ``a`` and ``b`` both lie within ``steps`` bf16 steps of the top logit's
    magnitude of the top one: a tie between the two that summation order (or, with an FP8 KV
    cache, each backend's rounding of what it reads) decides."""
    logits = logits.float()
    top = float(logits.max())
    margin = steps * 2.0 ** (math.floor(math.log2(abs(top) or 1e-30)) - 7)
    return top - float(logits[a]) <= margin and top - float(logits[b]) <= margin


def last_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """The engine's logits for the token after ``tokens``, caught at the LM head."""
    model = llm.engine.engine_core.executor.worker.model_runner.model
    caught: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: caught.append(o[-1].float().cpu()))
    try:
        llm.generate(
            {"prompt_token_ids": tokens},
            SamplingParams(max_tokens=1, temperature=0.0),
            use_tqdm=False,
        )
    finally:
        hook.remove()
    return caught[-1]


def check_same_or_near_tie(reference: LLM, prompt: list[int], want: list[int], got: list[int]):
    """Equal, or the first difference is at a near-tie of the reference engine's logits."""
    if got == want:
        return
    i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    assert near_tie(last_logits(reference, prompt + want[:i])), (
        f"diverges at token {i}, where the reference's top two logits are not a near-tie"
    )


def scale_random_weights(llm: LLM, std: float, seed: int = 0) -> None:
    """Redraw the engine's weights realistically scaled (``std``; norms around 1, not all 1),
    the same for every engine of one model and seed, whatever the load format drew."""
    model = llm.engine.engine_core.executor.worker.model_runner.model
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            scale, shift = (0.2, 1.0) if name.endswith("norm.weight") else (std, 0.0)
            r = torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.float32)
            p.copy_((r * scale + shift).to(p.dtype))
