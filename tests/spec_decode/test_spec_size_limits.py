"""A verification step scores each request's drafts and one more token: more draft tokens than
the step's token budget or the model's length could hold fail at start, naming both keys, instead
of failing where the verification graphs are captured or silently drafting less."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights

TINY = Path(__file__).parents[2] / "benchmarks" / "configs" / "tiny-llama"


def _llm(k: int, **kw) -> LLM:
    folder, _ = ensure_random_weights(TINY, 0, torch.device("cpu"))
    spec = {"method": "ngram", "num_speculative_tokens": k}
    return LLM(model=str(folder), device="cpu", speculative_config=spec, **kw)


def test_more_drafts_than_the_model_length_holds_fail_at_start() -> None:
    with pytest.raises(ValueError, match=r"num_speculative_tokens=256 does not fit model\."
                       r"max_model_len=256"):  # fmt: skip
        _llm(256, max_model_len=256)


def test_more_drafts_than_the_token_budget_holds_fail_at_start() -> None:
    with pytest.raises(ValueError, match=r"num_speculative_tokens=64 does not fit scheduler\."
                       r"max_num_batched_tokens=64"):  # fmt: skip
        _llm(64, max_model_len=256, max_num_batched_tokens=64)


def test_drafts_that_fill_the_budget_exactly_run() -> None:
    llm = _llm(63, max_model_len=256, max_num_batched_tokens=64)
    prompt = {"prompt_token_ids": list(range(10, 20)) * 4}
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12
