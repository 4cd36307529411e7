"""Random draws: frequencies match the filtered, tempered distribution (chi-square), and a seeded
request draws the same tokens whatever else is in the batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sampling_helpers import make_batch

from pagoda.sample.sampler import Sampler
from pagoda.sample.state import seeded_uniform
from pagoda.sampling_params import SamplingParams

V = 300  # more than two 128-token buckets, and not a multiple of 128
DRAWS = 50_000
Z_1E4 = 3.719  # upper 1e-4 quantile of the standard normal


def _chi2_critical(df: int) -> float:
    """Wilson-Hilferty: the chi-square quantile at significance 1e-4."""
    a = 2 / (9 * df)
    return df * (1 - a + Z_1E4 * math.sqrt(a)) ** 3


def _chi2(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom, cells with expected < 5 pooled into one."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] < 5:  # too little left to pool: fold it into the smallest cell
        obs[-2] += obs[-1]
        exp[-2] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0.7},
        {"temperature": 1.5, "top_k": 8},
        {"top_p": 0.7},
        {"temperature": 0.9, "min_p": 0.2},
        {"temperature": 1.2, "top_k": 50, "top_p": 0.9, "min_p": 0.02},
    ],
)
def test_sampled_frequencies_match_the_filtered_tempered_distribution(kw: dict) -> None:
    torch.manual_seed(0)
    ib, rows = make_batch([SamplingParams(**kw)], [[1]], vocab=V)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1)) * 2
    want = Sampler.probs(logits.clone(), ib.sampling_metadata(rows))[0].double().numpy()
    many = np.zeros(DRAWS, dtype=np.int64)  # the same request in every row
    md = ib.sampling_metadata(many)
    sampled = Sampler()(logits.expand(DRAWS, V).clone(), md).sampled.numpy()
    observed = np.bincount(sampled, minlength=V)
    assert observed[want == 0].sum() == 0  # nothing filtered out is ever drawn
    stat, df = _chi2(observed[want > 0], DRAWS * want[want > 0])
    assert df >= 4 and stat < _chi2_critical(df), (stat, df)


def test_seeded_uniforms_are_uniform_and_differ_by_seed() -> None:
    positions = np.arange(100_000)
    u = seeded_uniform(np.full(len(positions), 7, dtype=np.uint64), positions)
    observed = np.histogram(u, bins=50, range=(0, 1))[0]
    stat, df = _chi2(observed, np.full(50, len(u) / 50))
    assert stat < _chi2_critical(df) and 0 <= u.min() and u.max() < 1
    other = seeded_uniform(np.full(len(positions), 8, dtype=np.uint64), positions)
    assert abs(np.corrcoef(u, other)[0, 1]) < 0.02


def _seeded_tokens(seed: int, others: int, index: int, steps: int = 12) -> list[int]:
    """Draw ``steps`` tokens for a seeded request at batch position ``index`` among ``others``
    requests with their own (random or seeded) settings and different logits each step."""
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    params = [SamplingParams(temperature=0.8, seed=k if k % 2 else None) for k in range(others)]
    params.insert(index, target)
    ib, rows = make_batch(params, [[1, 2, 3]] * len(params), vocab=V, max_num_reqs=16)
    gen = torch.Generator().manual_seed(others * 100 + index)  # the batch's noise varies
    target_logits = torch.randn(steps, V, generator=torch.Generator().manual_seed(5)) * 0.3
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(params), V, generator=gen)
        logits[index] = target_logits[step]
        sampled = Sampler()(logits, ib.sampling_metadata(rows)).sampled
        ib.append_sampled(rows, sampled)
        tokens.append(int(sampled[index]))
    return tokens


def test_seeded_request_draws_the_same_tokens_alone_and_in_any_batch() -> None:
    alone = _seeded_tokens(1234, others=0, index=0)
    assert _seeded_tokens(1234, others=4, index=2) == alone
    assert _seeded_tokens(1234, others=9, index=9) == alone
    assert _seeded_tokens(1234, others=1, index=0) == alone
    assert _seeded_tokens(1235, others=0, index=0) != alone
