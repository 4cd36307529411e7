"""The rejection sampler's emitted tokens follow the target distribution exactly (chi-square over
many draws with a fixed seed), for one-hot drafts (n-gram) and drafts with probabilities, with q
close to and far from p; and the test has the power to reject the usual wrong samplers."""

from __future__ import annotations

import pytest
import torch

from pagoda.sample.ops import sample_from_probs
from pagoda.sample.rejection import rejection_sample

N = 60_000  # requests verified at once; each one is a draw
P_MIN = 1e-3  # chi-square p-value below which a sampler is wrong


def _chi_square_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of ``samples`` (token ids) against ``probs``."""
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of zero probability was drawn"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def _dist(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


P1 = _dist([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
P2 = _dist([0.05, 0.1, 0.4, 0.05, 0.3, 0.1])
CASES = {
    # (q at position 0, q at position 1); None: one-hot drafts drawn from the given q
    "one_hot_q_close": (P1, P2, None),
    "one_hot_q_far": (
        _dist([0.01, 0.01, 0.01, 0.02, 0.05, 0.9]),
        _dist([0.9, 0.02, 0.02, 0.02, 0.02, 0.02]),
        None,
    ),
    "probs_q_far": (
        _dist([0.02, 0.02, 0.06, 0.3, 0.3, 0.3]),
        _dist([0.5, 0.3, 0.1, 0.05, 0.03, 0.02]),
        True,
    ),
    "probs_q_uniform": (_dist([1] * 6), _dist([1] * 6), True),
}


def _draw_drafts(q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(q.expand(N, -1), 1, replacement=True, generator=gen).squeeze(1)


def _verify(sampler, q1, q2, with_probs, seed=0):
    """Two drafts per request drawn from q1, q2; the target has P1 then P2 then P1 (bonus)."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.stack([_draw_drafts(q1, gen), _draw_drafts(q2, gen)], dim=1)
    target = torch.stack([P1, P2, P1]).repeat(N, 1)  # rows: 3 per request
    starts = torch.arange(N) * 3
    draft_probs = torch.stack([q1, q2]).expand(N, 2, -1) if with_probs else None
    u_acc = torch.rand(3 * N, dtype=torch.float64, generator=gen)
    u_fin = torch.rand(3 * N, dtype=torch.float64, generator=gen)
    return sampler(
        target.argmax(dim=1),
        target,
        drafts,
        torch.full((N,), 2),
        starts,
        draft_probs=draft_probs,
        uniform_accept=u_acc,
        uniform_final=u_fin,
    )


def _draft_p_q(target, drafts, starts, draft_probs):
    rows = starts.unsqueeze(1) + torch.arange(drafts.shape[1])
    p_d = target[rows, drafts]
    if draft_probs is None:
        return rows, p_d, torch.ones_like(p_d)
    return rows, p_d, draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)


def _accept_if_p_greater(target_argmax, target, drafts, num_drafts, starts, **kw):
    """Wrong: accept a draft when p(d) >= q(d), else draw from p."""
    _, p_d, q_d = _draft_p_q(target, drafts, starts, kw["draft_probs"])
    return _wrong_tail(target, drafts, starts, p_d >= q_d, kw["uniform_final"])


def _resample_from_p(target_argmax, target, drafts, num_drafts, starts, **kw):
    """Wrong: accept with min(1, p/q) but draw the replacement from p, not max(0, p - q)."""
    rows, p_d, q_d = _draft_p_q(target, drafts, starts, kw["draft_probs"])
    accept = kw["uniform_accept"][rows] * q_d < p_d
    return _wrong_tail(target, drafts, starts, accept, kw["uniform_final"])


def _accept_argmax(target_argmax, target, drafts, num_drafts, starts, **kw):
    """Wrong for random rows: accept a draft iff it is the target's most likely token."""
    rows, _, _ = _draft_p_q(target, drafts, starts, None)
    return _wrong_tail(target, drafts, starts, target_argmax[rows] == drafts, kw["uniform_final"])


def _wrong_tail(target, drafts, starts, accept, uniform_final):
    n, k = drafts.shape
    num_acc = accept.long().cumprod(dim=1).sum(dim=1)
    rows = starts + num_acc
    final = sample_from_probs(target[rows], uniform_final[rows])
    tokens = torch.where(torch.arange(k) < num_acc.unsqueeze(1), drafts, -1)
    tokens = torch.cat([tokens, torch.full((n, 1), -1)], dim=1)
    tokens.scatter_(1, num_acc.unsqueeze(1), final.unsqueeze(1))
    return tokens, num_acc + 1


def _p_values(tokens: torch.Tensor, num_emitted: torch.Tensor) -> list[float]:
    """First token ~ P1; second (where emitted) ~ P2; third (where emitted) ~ P1."""
    out = [_chi_square_p(tokens[:, 0], P1)]
    for pos, p in ((1, P2), (2, P1)):
        have = num_emitted > pos
        if have.sum() > 500:
            out.append(_chi_square_p(tokens[have, pos], p))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_target_distribution(case: str) -> None:
    q1, q2, with_probs = CASES[case]
    tokens, num_emitted = _verify(rejection_sample, q1, q2, bool(with_probs))
    for p in _p_values(tokens, num_emitted):
        assert p > P_MIN, f"{case}: chi-square p-value {p:.2e}"


@pytest.mark.parametrize(
    ("wrong", "case"),
    [
        (_accept_if_p_greater, "probs_q_far"),
        (_resample_from_p, "probs_q_far"),
        (_resample_from_p, "one_hot_q_far"),
        (_resample_from_p, "one_hot_q_close"),
        (_accept_argmax, "one_hot_q_close"),
    ],
)
def test_the_chi_square_test_rejects_wrong_samplers(wrong, case: str) -> None:
    q1, q2, with_probs = CASES[case]
    tokens, num_emitted = _verify(wrong, q1, q2, bool(with_probs))
    assert min(_p_values(tokens, num_emitted)) < P_MIN


def test_greedy_rows_accept_the_argmax_prefix_and_end_with_the_argmax() -> None:
    logits = torch.tensor(
        [[0.0, 5, 1], [3, 0, 1], [0, 0, 9], [7, 1, 0], [0, 2, 1], [1, 0, 0]], dtype=torch.float32
    )
    argmax = logits.argmax(dim=1)  # 1, 0, 2, 0, 1, 0
    drafts = torch.tensor([[1, 0, 1], [1, 2, -1]])  # request 0: rows 0-3, request 1: rows 4-5
    tokens, n = rejection_sample(argmax, None, drafts, torch.tensor([3, 1]), torch.tensor([0, 4]))
    assert tokens.tolist() == [[1, 0, 2, -1], [1, 0, -1, -1]]
    assert n.tolist() == [3, 2]


def test_mixed_batch_greedy_rows_ignore_the_random_draws() -> None:
    probs = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.5, 0.5], [0.5, 0.5]])
    drafts = torch.tensor([[0], [0]])
    tokens, n = rejection_sample(
        probs.argmax(dim=1),
        probs,
        drafts,
        torch.tensor([1, 1]),
        torch.tensor([0, 2]),
        greedy=torch.tensor([True, False]),
        uniform_accept=torch.zeros(4, dtype=torch.float64),  # random row accepts draft 0
        uniform_final=torch.zeros(4, dtype=torch.float64),
    )
    assert tokens[0].tolist() == [1, -1]  # greedy: draft 0 is not the argmax (1)
    assert tokens[1, 0].item() == 0 and n.tolist() == [1, 2]
