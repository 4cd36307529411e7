"""Greedy output with an EAGLE-3 head is token for token the output without speculation on
SmolLM2-135M-Instruct (CPU, float32): a head trained here from SmolLM2's own outputs (a few
prompts, as ``pagoda-train-eagle3`` does it, so some drafts are accepted) and a random one
(nothing accepted). Prompts are prefilled in chunks, so the head also receives the hidden states
of chunks computed before a request first samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("pagoda_spec_eagle")

from pagoda_spec_eagle.checkpoint import (  # noqa: E402
    llama_head_config,
    random_head_weights,
    write_head,
)
from pagoda_spec_eagle.record import corpus, generate_and_record  # noqa: E402
from pagoda_spec_eagle.train import train_head  # noqa: E402

from pagoda import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

BASE = {"max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}
CHUNKED = {"max_num_batched_tokens": 64}
NUM_TRAIN = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """A head trained on SmolLM2's greedy continuations of a few prompts; the held-out prompts."""
    messages = corpus(NUM_TRAIN, seed=1) + corpus(2, seed=1, heldout=True)
    data, target, heldout = generate_and_record(BASE, messages, NUM_TRAIN, 24, progress=False)
    weights, config, _ = train_head(
        data, target, draft_vocab=2048, epochs=10, steps=3, lr=3e-3, tokens_per_batch=4096,
        feature_weight=0.1, device=torch.device("cpu"), seed=0, progress=False,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("eagle3-smollm2")
    write_head(folder, config, weights)
    # Held out, and a prompt the model continues predictably.
    return folder, heldout + [data[0].tokens.tolist()[: data[0].num_prompt + 8]]


@pytest.fixture(scope="module")
def reference(trained) -> list[list[int]]:
    return _generate(LLM(**BASE), trained[1])


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=16, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_trained_eagle3_head_keeps_greedy_output_and_drafts_are_accepted(trained, reference):
    spec = {"method": "eagle3", "model": str(trained[0]), "num_speculative_tokens": 4}
    llm = LLM(**BASE, **CHUNKED, speculative_config=spec)
    assert _generate(llm, trained[1]) == reference
    assert llm.engine.engine_core.scheduler.spec_stats_total.num_accepted_tokens > 0


def test_random_eagle3_head_keeps_greedy_output(tmp_path, trained, reference):
    cfg = llama_head_config("eagle3", 576, 1536, 9, 3, 49152, draft_vocab_size=4096)
    write_head(tmp_path / "head", cfg, random_head_weights(cfg, seed=3, std=0.2))
    spec = {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 4}
    llm = LLM(**BASE, **CHUNKED, speculative_config=spec)
    assert _generate(llm, trained[1]) == reference
    assert llm.engine.engine_core.scheduler.spec_stats_total.num_draft_tokens > 0
