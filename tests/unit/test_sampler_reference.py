"""Each logits setting against an independent reference on the same logits: transformers' logits
processors (repetition penalty, temperature, top-k, top-p, min-p), OpenAI's formula (presence and
frequency penalties), and hand-built cases (bias, allowed ids, bad words, min tokens)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from sampling_helpers import make_batch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import SamplingParams

V = 64
NEG_INF = float("-inf")


def _logits(n: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale


def _process(params, prompts, outputs=None, logits=None):
    ib, rows = make_batch(params, prompts, outputs, vocab=V)
    logits = _logits(len(params)) if logits is None else logits
    return logits, Sampler().process_logits(logits.clone(), ib.sampling_metadata(rows))


def test_repetition_penalty_matches_transformers_over_prompt_and_output() -> None:
    prompts = [[1, 2, 3, 3, 40], [7, 8], [5, 6]]
    outputs = [[9, 1, 50], [60, 61, 7], [5]]
    penalties = [1.3, 0.7, 1.0]
    params = [SamplingParams(temperature=0, repetition_penalty=p) for p in penalties]
    ib, rows = make_batch(params, prompts, outputs, vocab=V)
    logits = _logits(3)
    # One more sampled token per row must count from the next step on.
    ib.append_sampled(rows, torch.tensor([20, 21, 22]))
    got = Sampler().process_logits(logits.clone(), ib.sampling_metadata(rows))
    for i, penalty in enumerate(penalties):
        seen = torch.tensor([prompts[i] + outputs[i] + [20 + i]])
        want = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i], want[0], rtol=0, atol=1e-6)
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])


def test_presence_and_frequency_penalties_follow_openai_over_the_output_only() -> None:
    prompts = [[4, 4, 4, 11], [2]]
    outputs = [[11, 11, 12, 30, 11], [2, 3]]
    presence, frequency = [0.5, -1.0], [0.25, 2.0]
    params = [
        SamplingParams(temperature=0, presence_penalty=p, frequency_penalty=f)
        for p, f in zip(presence, frequency)
    ]
    logits, got = _process(params, prompts, outputs)
    for i in range(2):
        want = logits[i].clone()
        for token, count in Counter(outputs[i]).items():
            want[token] -= count * frequency[i] + presence[i]
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    assert got[0, 4] == logits[0, 4]  # prompt-only token: untouched


def _hf_reference(logits: torch.Tensor, kw: dict) -> torch.Tensor:
    """transformers' warpers in vLLM's order: temperature, min-p, top-k, top-p, then softmax."""
    scores = logits.unsqueeze(0).clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    warpers = [TemperatureLogitsWarper(kw.get("temperature", 1.0))]
    if kw.get("min_p"):
        warpers.append(MinPLogitsWarper(kw["min_p"]))
    if kw.get("top_k"):
        warpers.append(TopKLogitsWarper(kw["top_k"]))
    if kw.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(kw["top_p"]))
    for warp in warpers:
        scores = warp(ids, scores)
    return scores.softmax(dim=-1)[0]


ROWS_TOP_K_ONLY = [
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_k": 1},
    {"temperature": 1.0},
    {"temperature": 0.5, "top_k": 40, "min_p": 0.02},
]
ROWS_ALL_FILTERS = [
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 0.5, "top_k": 10, "top_p": 0.9},
    {"temperature": 2.0, "top_p": 0.5, "min_p": 0.05},
    {"temperature": 1.0},
]
# A vocabulary wider than the 256 candidates top-p looks at first: flat rows (scale 0.5) need
# the full sort, peaked ones (scale 6) do not; a top-k above 256 as well.
ROWS_WIDE = [
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.8, "top_k": 400, "top_p": 0.95},
    {"temperature": 1.0, "top_k": 300, "top_p": 0.3},
    {"temperature": 1.0, "top_k": 600},
    {"temperature": 1.5, "min_p": 0.01, "top_p": 0.99},
    {"temperature": 1.0},
]


@pytest.mark.parametrize(
    ("rows", "vocab", "scales"),
    [
        (ROWS_TOP_K_ONLY, V, [3.0] * 4),
        (ROWS_ALL_FILTERS, V, [3.0] * 6),
        (ROWS_WIDE, 1000, [0.5, 6.0, 0.5, 6.0, 1.0, 0.5, 1.0]),
    ],
    ids=["top_k", "all", "wide"],
)
def test_temperature_min_p_top_k_top_p_match_transformers(
    rows: list[dict], vocab: int, scales: list[float]
) -> None:
    params = [SamplingParams(**kw) for kw in rows]
    ib, batch_rows = make_batch(params, [[1]] * len(rows), vocab=vocab)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(3))
    logits *= torch.tensor(scales).unsqueeze(1)
    probs = Sampler.probs(logits.clone(), ib.sampling_metadata(batch_rows))
    for i, kw in enumerate(rows):
        want = _hf_reference(logits[i], kw)
        torch.testing.assert_close(probs[i], want, rtol=0, atol=1e-6)
        assert torch.equal(probs[i] > 0, want > 0), kw


def test_logit_bias_adds_to_the_named_tokens_of_its_row_only() -> None:
    params = [SamplingParams(logit_bias={3: 5.0, "10": -2.5}), SamplingParams()]
    logits, got = _process(params, [[1], [1]])
    want = logits.clone()
    want[0, 3] += 5.0
    want[0, 10] -= 2.5
    assert torch.equal(got, want)


def test_allowed_token_ids_mask_every_other_token_of_that_row() -> None:
    params = [SamplingParams(allowed_token_ids=[1, 4, 63]), SamplingParams()]
    logits, got = _process(params, [[1], [1]])
    kept = torch.isfinite(got[0]).nonzero().flatten().tolist()
    assert kept == [1, 4, 63] and torch.equal(got[0, kept], logits[0, kept])
    assert torch.equal(got[1], logits[1])


def test_bad_words_block_their_last_token_once_the_rest_ends_the_output() -> None:
    words = [[7], [3, 4], [1, 2, 6]]
    params = [SamplingParams(bad_words_token_ids=words) for _ in range(4)]
    prompts = [[9], [9], [1, 2], [1]]
    outputs = [[5, 3], [1, 2], [], [2]]  # row 2 and 3: the prefix [1, 2] is not all output
    logits, got = _process(params, prompts, outputs)
    blocked = [set((~torch.isfinite(row)).nonzero().flatten().tolist()) for row in got]
    assert blocked == [{7, 4}, {7, 6}, {7}, {7}]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    def params(**kw) -> SamplingParams:
        return SamplingParams(min_tokens=3, stop_token_ids=[5], **kw).resolve(None, V, {2})

    rows = [params(), params(), params(ignore_eos=True)]
    outputs = [[8, 8], [8, 8, 8], [8]]
    logits, got = _process(rows, [[1]] * 3, outputs)
    blocked = [set((~torch.isfinite(row)).nonzero().flatten().tolist()) for row in got]
    assert blocked == [{2, 5}, set(), {5}]


def test_bias_applies_before_the_repetition_penalty_as_in_vllm() -> None:
    logits = torch.zeros(1, V)
    logits[0, 3] = -1.0
    params = [SamplingParams(logit_bias={3: 2.0}, repetition_penalty=2.0)]
    _, got = _process(params, [[3]], logits=logits)
    assert got[0, 3].item() == pytest.approx(0.5)  # (-1 + 2) / 2, not -1 * 2 + 2


def test_out_of_vocabulary_ids_and_empty_allowed_list_name_the_field() -> None:
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={V: 1.0}).resolve(None, V, set())
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[-1]).resolve(None, V, set())
