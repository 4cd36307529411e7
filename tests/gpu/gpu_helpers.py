"""Shared by the GPU tests: near-tie checks on bf16 logits."""

from __future__ import annotations

import math

import torch

from pagoda import LLM, SamplingParams

#: Two logits within this many bf16 steps (8 bits of mantissa) of the top one's magnitude are a
#: tie that summation order decides.
BF16_STEPS = 2


def near_tie(logits: torch.Tensor) -> bool:
    top2 = logits.float().topk(2).values
    top, gap = float(top2[0]), float(top2[0] - top2[1])
    return gap <= BF16_STEPS * 2.0 ** (math.floor(math.log2(abs(top) or 1e-30)) - 7)


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
