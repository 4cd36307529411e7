"""Speculation beside structured output: a constrained request in a batch whose other requests
verify drafts still gets only what its grammar allows (it gets no drafts of its own), and the
unconstrained requests keep their greedy output."""

from __future__ import annotations

import re

import pytest

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import StructuredOutputsParams

pytest.importorskip("xgrammar")

ENGINE = {"max_model_len": 256, "kv_cache_memory_bytes": 32 << 20}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
REPEAT = "Say again: one two three one two three one two three one two three"


def test_constrained_request_beside_drafting_ones_follows_its_grammar() -> None:
    plain = SamplingParams(max_tokens=16, temperature=0.0)
    regex = r"(yes|no), [0-9]{2}"
    constrained = SamplingParams(
        max_tokens=16, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    prompts = [REPEAT, "Answer yes or no, then a number:", REPEAT + " one"]
    params = [plain, constrained, plain]
    llm = LLM(**ENGINE, speculative_config=SPEC)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert re.fullmatch(regex, outs[1].outputs[0].text), outs[1].outputs[0].text
    stats = llm.engine.engine_core.scheduler.spec_stats_total
    assert stats.num_drafts > 0
    want = LLM(**ENGINE).generate([prompts[0], prompts[2]], plain, use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [
        w.outputs[0].token_ids for w in want
    ]
