"""Greedy outputs on SmolLM2 (its GGUF weights) equal transformers' greedy ``generate``, token for
token, for a batch of 16 prompts of 5 to 600 tokens: as they come, with chunked prefill forced,
and with a KV cache small enough that requests are preempted."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams

MAX_TOKENS = 32
PROMPT_LENGTHS = [5, 9, 17, 33, 48, 64, 90, 128, 170, 230, 300, 360, 420, 480, 540, 600]
PASSAGE = (
    "The history of the city begins with a small fishing village on the river bank. Over the "
    "centuries, merchants arrived from distant lands, bringing spices, silk and new ideas. The "
    "village grew into a town, and the town into a city with bridges, markets and a cathedral "
    "whose bells could be heard across the valley. Scholars founded a university; printers set "
    "up their presses near the harbour; and every spring a fair filled the squares with music. "
)


def _prompts(tokenizer) -> list[str | dict]:
    """Half plain text, half token ids, of the lengths above (text is cut to its token length)."""
    ids = tokenizer.encode(PASSAGE * 20, add_special_tokens=False)
    prompts: list[str | dict] = []
    for i, n in enumerate(PROMPT_LENGTHS):
        chunk = ids[i * 7 : i * 7 + n]
        if i % 2:
            prompts.append({"prompt_token_ids": chunk})
        else:
            prompts.append(tokenizer.decode(chunk))
    return prompts


@pytest.fixture(scope="module")
def reference(hf_smollm2, smollm2_tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, transformers' greedy output ids), each prompt generated alone."""
    out = []
    for p in _prompts(smollm2_tokenizer):
        ids = p["prompt_token_ids"] if isinstance(p, dict) else smollm2_tokenizer.encode(p)
        with torch.inference_mode():
            gen = hf_smollm2.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
        out.append((ids, gen[0, len(ids) :].tolist()))
    return out


def _check_same_or_near_tie(hf_model, prompt: list[int], want: list[int], got: list[int]) -> None:
    """Equal, or the first difference is at a near-tie of transformers' top two logits."""
    if got == want:
        return
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + want[:i]])).logits[0, -1]
    top2 = logits.topk(2).values
    gap = float((top2[0] - top2[1]).abs() / top2[0].abs())
    assert gap <= 1e-4, (
        f"outputs diverge at token {i} where transformers' top two logits are {gap:.2e} apart "
        f"(relative), not a near-tie: got {got[i : i + 5]}, want {want[i : i + 5]}"
    )


def _run(llm: LLM, tokenizer) -> list[list[int]]:
    outs = llm.generate(_prompts(tokenizer), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [o.outputs[0].token_ids for o in outs]


ENGINES = {
    "default": {},
    "chunked_prefill_64": {"max_num_batched_tokens": 64},
    # 65 blocks of 16 hold 1024 tokens; the batch needs about 4,000 at once, so requests are
    # preempted and recomputed.
    "preempting_small_cache": {"num_gpu_blocks_override": 65, "max_model_len": 1024},
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_batch_matches_transformers_token_for_token(
    engine, reference, hf_smollm2, smollm2_tokenizer
) -> None:
    llm = LLM(**ENGINES[engine])
    got = _run(llm, smollm2_tokenizer)
    scheduler = llm.engine.engine_core.scheduler
    if engine == "preempting_small_cache":
        assert scheduler.num_preemptions_total > 0
    if engine == "chunked_prefill_64":
        assert scheduler.max_num_batched_tokens == 64
    for (prompt, want), tokens in zip(reference, got):
        _check_same_or_near_tie(hf_smollm2, prompt, want, tokens)
    kv = llm.engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == llm.engine.engine_core.num_blocks - 1
