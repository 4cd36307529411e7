"""Greedy output with n-gram speculation is token for token the output without it, on SmolLM2
(CPU, float32), for 32 prompts: half ask to repeat standard-library source given in the prompt
(drafts often accepted), half count from random starts by one or by seven, where digit n-grams
recur but their earlier continuations are wrong (drafts mostly rejected). Chunked prefill,
prefix caching (a second round continues each output, reading blocks written while drafts were
verified) and preemption (a KV cache too small for the batch) are all exercised, and every block
comes back."""

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


def _count_prompts(tokenizer) -> list[list[int]]:
    """Counting from random starts, by one and by seven: digit n-grams recur all the time, but
    what followed them before is not what comes next, so drafts keep coming and are mostly
    refused."""
    rng = random.Random(0)
    out = []
    for i, start in enumerate(rng.sample(range(5, 400), 16)):
        step, sep = (1, ", ") if i % 2 else (7, " ")
        text = sep.join(str(start + step * k) for k in range(12 + i // 2))
        out.append(tokenizer.encode(text + sep.strip(), add_special_tokens=False))
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
        "counts": _count_prompts(smollm2_tokenizer),
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


# NOTE: alternating drafts while 8 or more requests run, as the 16-prompt batches start, draft
# slots below, as they finish (``pagoda.scheduler.draft_policy``).
def test_greedy_output_with_ngram_speculation_is_token_identical(prompts, reference) -> None:
    llm = LLM(**BASE, **ENGINES["chunked_prefill_and_prefix_caching"], speculative_config=SPEC)
    core = llm.engine.engine_core
    total = core.scheduler.spec_stats_total
    got_source = _generate(llm, prompts["source"])
    accepted_source = total.acceptance_rate
    # NOTE: right after, while the blocks of the first round are still cached (the cache is small).
    hits_before = core.kv_cache_manager.prefix_cache_stats.hits
    got_continued = _generate(llm, _continued(prompts, {"source": got_source}))
    hits = core.kv_cache_manager.prefix_cache_stats.hits - hits_before
    before = total.num_draft_tokens, total.num_accepted_tokens
    got_counts = _generate(llm, prompts["counts"])
    drafts = total.num_draft_tokens - before[0]
    accepted = total.num_accepted_tokens - before[1]

    assert got_source == reference["source"]
    assert got_counts == reference["counts"]
    assert got_continued == reference["continued"]
    # The groups exercise what they are meant to: drafts often kept, and mostly refused.
    assert accepted_source > 0.2, accepted_source
    assert drafts > 50 and accepted / drafts < min(0.5, accepted_source), (drafts, accepted)
    assert hits >= 16 * 6, hits  # the continued prompts found their first round's blocks
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1


def test_greedy_output_with_ngram_speculation_is_token_identical_under_preemption(
    prompts, reference
) -> None:
    llm = LLM(**BASE, **ENGINES["preempting_small_cache"], speculative_config=SPEC)
    core = llm.engine.engine_core
    n = PREEMPTED_PER_GROUP
    subset = prompts["source"][:n] + prompts["counts"][:n]
    got = _generate(llm, subset)
    assert got == reference["source"][:n] + reference["counts"][:n]
    assert core.scheduler.num_preemptions_total > 0
    assert core.scheduler.spec_stats_total.num_accepted_tokens > 0
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1
