"""Greedy output with an EAGLE or EAGLE-3 head (random values) is token for token the output
without speculation, on a tiny random Llama: prompts prefilled in chunks (the head receives
every chunk's hidden states when the request first samples) and a second round that hits the
prefix cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from eagle_helpers import TINY_LLAMA, write_random_head

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights

ENGINE = {"device": "cpu", "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 32}


def _prompts() -> list[dict]:
    rng = np.random.default_rng(3)
    out = [{"prompt_token_ids": rng.integers(10, 300, int(n)).tolist()} for n in (5, 40, 17, 70)]
    out.append({"prompt_token_ids": [7, 8, 9, 10] * 6})
    return out


def _generate(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def target() -> str:
    folder, _ = ensure_random_weights(TINY_LLAMA, 0, torch.device("cpu"))
    return str(folder)


@pytest.fixture(scope="module")
def reference(target: str) -> list[list[int]]:
    return _generate(LLM(model=target, **ENGINE), _prompts())


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_random_head_keeps_greedy_output(
    tmp_path: Path, target: str, reference: list[list[int]], kind: str
) -> None:
    head = write_random_head(tmp_path / kind, kind, 64, 1024, draft_vocab=256, std=0.3)
    spec = {"method": kind, "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(model=target, **ENGINE, speculative_config=spec)
    assert _generate(llm, _prompts()) == reference
    again = _generate(llm, _prompts())  # prefix cache hits: the head reads cached blocks
    assert again == reference
    stats = llm.engine.engine_core.scheduler.spec_stats_total
    assert stats.num_draft_tokens > 0
