"""Tiny random models of twelve architectures, served by the transformers impl, against
transformers itself: logits within 1e-4 at every position through a paged cache (block size 4,
chunked prefill, a prefix-cache hit, mixed decode steps), and an engine's greedy tokens equal to
``generate``'s (a mismatch allowed only where the reference's top two logits nearly tie)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tf_parity import ARCHS, build_ours, hf_model, max_logit_error, run_scenario, save

from pagoda import LLM, SamplingParams

NUM_PROMPTS = 8
MAX_TOKENS = 32
NEAR_TIE = 1e-4


def _prompts(vocab: int) -> list[list[int]]:
    """Eight prompts of 5 to 33 tokens; four share a 12-token prefix (a prefix-cache hit)."""
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, vocab, (12,), generator=gen).tolist()
    out = []
    for i in range(NUM_PROMPTS):
        own = torch.randint(3, vocab, (5 + 4 * i,), generator=gen).tolist()
        out.append(shared + own[: 1 + i] if i % 2 else own)
    return out


def _check_greedy(hf, prompt: list[int], got: list[int]) -> None:
    with torch.inference_mode():
        want = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        if g == w:
            continue
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + want[:step]])).logits[0, -1]
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < NEAR_TIE, (
            f"step {step}: pagoda chose {g}, transformers {w} with a top-2 gap of {gap:.2e}"
        )
        return  # a near-tie: the continuations may part from here


@pytest.mark.parametrize("model_type", ARCHS)
def test_logits_match_transformers_through_a_paged_cache(model_type: str, tmp_path: Path) -> None:
    hf = hf_model(model_type)
    ours = build_ours(save(hf, tmp_path))
    seqs = run_scenario(ours, hf.config.vocab_size)
    assert max_logit_error(hf, seqs) < 1e-4


@pytest.mark.parametrize("model_type", ARCHS)
def test_engine_greedy_tokens_match_transformers_generate(model_type: str, tmp_path) -> None:
    hf = hf_model(model_type)
    folder = save(hf, tmp_path)
    llm = LLM(
        model=str(folder),
        model_impl="transformers",
        device="cpu",
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        max_model_len=128,
        kv_cache_memory_bytes=1 << 22,
    )
    assert llm.engine.info.model_impl == "transformers"
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs, strict=True):
        _check_greedy(hf, prompt, list(out.outputs[0].token_ids))


@pytest.mark.parametrize("model_type", ["gpt2", "opt"])
def test_logits_of_heads_that_call_their_base_model_otherwise(model_type: str, tmp_path) -> None:
    """GPT-2 calls its base model with positional arguments, OPT a part of it
    (``model.decoder``): the head still runs on the given hidden states."""
    hf = hf_model(model_type)
    ours = build_ours(save(hf, tmp_path))
    assert max_logit_error(hf, run_scenario(ours, hf.config.vocab_size)) < 1e-4
