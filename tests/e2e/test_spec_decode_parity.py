"""Greedy output with n-gram speculation is token for token the output without it, on SmolLM2
(CPU, float32), for 32 prompts: half ask to repeat standard-library source given in the prompt
(drafts often accepted), half are random sequences of three words whose recurring n-grams
have random continuations (drafts mostly rejected). Chunked prefill, prefix caching (a second
round continues each output, reading blocks written while drafts were verified) and preemption
(a KV cache too small for the batch) are all exercised, and every block comes back."""

from __future__ import annotations

import inspect
import random
import textwrap

import pytest

from pagoda import LLM, SamplingParams

MAX_TOKENS = 20
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
SPEC["prompt_lookup_max"] = 4
BASE = {"max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}
ENGINES = {
    # Prompts of up to ~130 tokens are prefilled in chunks of 64; drafts share the budget.
    "chunked_prefill_and_prefix_caching": {"max_num_batched_tokens": 64},
    # 40 blocks of 16 tokens hold 640 tokens; 12 requests need about twice that.
    "preempting_small_cache": {"num_gpu_blocks_override": 40},
}
PREEMPTED_PER_GROUP = 6


def _source_prompts(tokenizer) -> list[list[int]]:
    funcs = [textwrap.dedent, textwrap.indent, textwrap.shorten, random.Random.shuffle]
    funcs += [random.Random.choice, random.Random.sample, inspect.getsource, inspect.cleandoc]
    out = []
    for i, fn in enumerate(funcs * 2):
        src = inspect.getsource(fn)
        ids = tokenizer.encode(src, add_special_tokens=False)[: 30 + 6 * i]
        lead = "Repeat this code exactly:\n" if i % 2 else "Copy the following text.\n"
        out.append(tokenizer.encode(lead, add_special_tokens=False) + ids + [198])
    return out


def _color_prompts(tokenizer) -> list[list[int]]:
    """Random sequences over ten words: 2-grams recur with random followers, so n-gram drafts
    keep coming and the model mostly refuses them."""
    rng = random.Random(0)
    words = ["red", "blue", "green", "cat", "dog", "fox", "one", "two", "six", "sun"]
    out = []
    for i in range(16):
        seq = " ".join(rng.choice(words) for _ in range(40 + 2 * i))
        out.append(tokenizer.encode(f"Words: {seq}", add_special_tokens=False))
    return out


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> dict[str, list[list[int]]]:
    return {
        "source": _source_prompts(smollm2_tokenizer),
        "colors": _color_prompts(smollm2_tokenizer),
    }


@pytest.fixture(scope="module")
def reference(prompts) -> dict[str, list[list[int]]]:
    llm = LLM(**BASE)
    ref = {name: _generate(llm, ps) for name, ps in prompts.items()}
    ref["continued"] = _generate(llm, _continued(prompts, ref))
    return ref


def _continued(prompts, outputs) -> list[list[int]]:
    """Round two: source prompts plus most of their first output, whose blocks are cached."""
    return [p + o[:-3] for p, o in zip(prompts["source"][-6:], outputs["source"][-6:])]


def test_greedy_output_with_ngram_speculation_is_token_identical(prompts, reference) -> None:
    llm = LLM(**BASE, **ENGINES["chunked_prefill_and_prefix_caching"], speculative_config=SPEC)
    core = llm.engine.engine_core
    total = core.scheduler.spec_stats_total
    got_source = _generate(llm, prompts["source"])
    accepted_source = total.acceptance_rate
    before = total.num_draft_tokens, total.num_accepted_tokens
    got_colors = _generate(llm, prompts["colors"])
    drafts = total.num_draft_tokens - before[0]
    accepted = total.num_accepted_tokens - before[1]
    hits_before = core.kv_cache_manager.prefix_cache_stats.hits
    got_continued = _generate(llm, _continued(prompts, {"source": got_source}))

    assert got_source == reference["source"]
    assert got_colors == reference["colors"]
    assert got_continued == reference["continued"]
    # The groups exercise what they are meant to: drafts often kept, and mostly refused.
    assert accepted_source > 0.2, accepted_source
    assert drafts > 50 and accepted / drafts < min(0.5, accepted_source), (drafts, accepted)
    assert core.kv_cache_manager.prefix_cache_stats.hits > hits_before
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1


def test_greedy_output_with_ngram_speculation_is_token_identical_under_preemption(
    prompts, reference
) -> None:
    llm = LLM(**BASE, **ENGINES["preempting_small_cache"], speculative_config=SPEC)
    core = llm.engine.engine_core
    n = PREEMPTED_PER_GROUP
    subset = prompts["source"][:n] + prompts["colors"][:n]
    got = _generate(llm, subset)
    assert got == reference["source"][:n] + reference["colors"][:n]
    assert core.scheduler.num_preemptions_total > 0
    assert core.scheduler.spec_stats_total.num_accepted_tokens > 0
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1
