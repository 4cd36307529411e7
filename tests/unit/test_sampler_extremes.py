"""Sampling parameters at the edge of what the API accepts never fail a step (a failed step
ends the engine process, and every request with it)."""

from __future__ import annotations

import pytest
import torch
from sampling_helpers import make_batch

from pagoda.sample.ops import apply_top_k_top_p
from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import SamplingParams

V = 300  # more than top-p's 256 candidates


def _logits(n: int) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.parametrize("top_p", [0.0, 1e-45])
def test_a_top_p_that_rounds_to_nothing_keeps_the_likeliest_token(top_p: float) -> None:
    logits = _logits(4)
    kept = apply_top_k_top_p(logits.clone(), None, V, torch.full((4,), top_p))
    assert torch.equal(kept.isfinite().sum(-1), torch.ones(4, dtype=torch.long))
    assert torch.equal(kept.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize(
    "params",
    [
        {"top_p": 5e-324},  # > 0 as the API checks it, 0 in the sampler's float32
        {"top_p": 5e-324, "top_k": 1, "min_p": 1.0},
        {"temperature": 1.0001e-5},  # just above greedy
        {"temperature": 2.0, "top_k": 10**9, "min_p": 5e-324},
        {"logit_bias": {3: 100.0, 4: -100.0}, "frequency_penalty": 2.0, "presence_penalty": -2},
    ],
)
def test_edge_parameters_sample_a_token_of_the_vocabulary(params: dict) -> None:
    sp = SamplingParams(seed=1, **{"temperature": 1.0, **params})
    ib, rows = make_batch([sp] * 3, [[1, 2, 3]] * 3, vocab=V)
    out = Sampler()(_logits(3), ib.sampling_metadata(rows))
    assert ((out.sampled >= 0) & (out.sampled < V)).all(), out.sampled
    if params.get("top_p") == 5e-324:
        assert torch.equal(out.sampled, _logits(3).argmax(-1))  # top_p ~0: the likeliest
