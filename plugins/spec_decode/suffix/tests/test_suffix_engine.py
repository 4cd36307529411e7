"""On SmolLM2 (CPU): a request that repeats an earlier request's answer has drafts accepted
from the global tree, which holds that answer; with the global tree off (``plugins.suffix.
global_max_tokens: 0``) the same request drafts from its own prompt only and gets few; greedy
output is the same either way. Drafting runs every step (``adaptive: false``): this pins the
proposer, not the governor."""

from __future__ import annotations

from pagoda import LLM, SamplingParams

BASE = {"max_model_len": 256, "kv_cache_memory_bytes": 32 << 20}
MAX_TOKENS = 16
# Drafting every step: the governor's choice would be measured on two short requests.
SPEC = {"method": "suffix", "adaptive": False}
PROMPT = "Write a short poem about the sea."


def _second_request_accepted(global_max_tokens: int | None) -> tuple[int, list[int]]:
    plugins = {} if global_max_tokens is None else {"suffix": {"global_max_tokens": 0}}
    llm = LLM(**BASE, speculative_config=SPEC, plugins=plugins)
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    stats = llm.engine.engine_core.scheduler.spec_stats_total
    llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)
    before = stats.num_accepted_tokens
    out = llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)
    return stats.num_accepted_tokens - before, list(out[0].outputs[0].token_ids)


def test_second_request_repeating_an_answer_gets_drafts_accepted_from_the_global_tree() -> None:
    accepted, tokens = _second_request_accepted(None)
    accepted_off, tokens_off = _second_request_accepted(0)
    assert tokens == tokens_off
    assert accepted >= MAX_TOKENS // 2, accepted
    assert accepted_off < accepted // 2, (accepted_off, accepted)
