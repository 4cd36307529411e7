"""``GreedyVerifyGraphs``: a step's all-greedy verification (logits, argmax, the greedy
comparison, each request's last token and last emitted hidden row) as the rejection sampler and
the eager gathers give it. On the CPU it runs eagerly (the same operations a CUDA graph
captures)."""

from __future__ import annotations

import pytest
import torch

from pagoda.sample.rejection import rejection_sample
from pagoda.worker.greedy_verify_graphs import MAX_ROWS, GreedyVerifyGraphs

HIDDEN, VOCAB = 16, 50


class _Model:
    def __init__(self) -> None:
        self.w = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.w.T).float()


class _Runner:
    def __init__(self) -> None:
        self.model = _Model()
        self.input_ids = torch.zeros(MAX_ROWS * 2, dtype=torch.int64)


class _VerifyGraphs:
    def __init__(self, q: int) -> None:
        self.query_len = q
        self.buckets = [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_greedy_graphs_are_the_rejection_sampler_and_the_gathers(k: int, n: int) -> None:
    q = k + 1
    runner = _Runner()
    tail = GreedyVerifyGraphs(runner.model, runner.input_ids, _VerifyGraphs(q), graphs=False)
    g = torch.Generator().manual_seed(n * 10 + k)
    hidden = torch.randn(n * q, HIDDEN, generator=g)
    argmax = runner.model.compute_logits(hidden).argmax(dim=-1).view(n, q)
    # Request i's drafts match the target's argmax for its first i % q positions.
    drafts = torch.randint(0, VOCAB, (n, k), generator=g)
    for i in range(n):
        j = i % q
        drafts[i, :j] = argmax[i, :j]
        if j < k:
            drafts[i, j] = (argmax[i, j] + 1) % VOCAB
    ids = torch.cat([torch.randint(0, VOCAB, (n, 1), generator=g), drafts], dim=1)
    runner.input_ids[: n * q] = ids.reshape(-1)

    got = tail.run(hidden, n)

    starts = torch.arange(n) * q
    tokens, emitted = rejection_sample(
        argmax.reshape(-1), None, drafts, torch.full((n,), k), starts, kernel=False
    )
    assert torch.equal(got.tokens, tokens)
    assert torch.equal(got.num_emitted, emitted)
    assert got.num_emitted.tolist() == [i % q + 1 for i in range(n)]
    assert torch.equal(got.last_token, tokens[:, k].clamp(min=0))
    assert torch.equal(got.last_hidden, hidden[starts + emitted - 1])


@pytest.mark.parametrize("n", [1, 3, 8])
def test_requests_with_fewer_drafts_are_verified_over_their_padded_rows(n: int) -> None:
    # A verification graph pads each request to q rows, its real ones first; the greedy graphs
    # compare only each request's own drafts and return its token at its draft count.
    k = 4
    q = k + 1
    runner = _Runner()
    tail = GreedyVerifyGraphs(runner.model, runner.input_ids, _VerifyGraphs(q), graphs=False)
    g = torch.Generator().manual_seed(n)
    hidden = torch.randn(n * q, HIDDEN, generator=g)
    argmax = runner.model.compute_logits(hidden).argmax(dim=-1).view(n, q)
    nd = torch.tensor([(i * 3 + 1) % q for i in range(n)])  # 1, 4, 2, 0, 3 ...
    ids = torch.randint(0, VOCAB, (n, q), generator=g)
    for i in range(n):
        # Every real draft is the target's token (all accepted); the padding rows hold ids that
        # the target also predicts, which a graph reading k drafts would accept too.
        ids[i, 1:q] = argmax[i, :k]
    runner.input_ids[: n * q] = ids.reshape(-1)

    got = tail.run(hidden, n, nd)

    starts = torch.arange(n) * q
    tokens, emitted = rejection_sample(
        argmax.reshape(-1), None, ids[:, 1:], nd, starts, kernel=False
    )
    assert got.num_emitted.tolist() == (nd + 1).tolist()
    assert torch.equal(got.tokens, tokens)
    assert got.last_token.tolist() == [int(argmax[i, nd[i]]) for i in range(n)]
    assert torch.equal(got.last_hidden, hidden[starts + emitted - 1])
    # Back to k drafts each: the counts of the step before do not stay.
    assert tail.run(hidden, n).num_emitted.tolist() == [q] * n


def test_steps_the_greedy_graphs_do_not_cover_go_back_to_the_caller() -> None:
    q = 4
    runner = _Runner()
    tail = GreedyVerifyGraphs(runner.model, runner.input_ids, _VerifyGraphs(q), graphs=False)
    assert max(tail.buckets) == MAX_ROWS // q  # the largest bucket within the limit
    too_many = max(tail.buckets) + 1
    assert tail.run(torch.zeros(too_many * q, HIDDEN), too_many) is None
    assert tail.run(torch.zeros(2 * q - 1, HIDDEN), 2) is None  # a request with fewer drafts
    assert tail.run(torch.zeros(2 * q, HIDDEN), 2) is not None
    assert tail.replays == 1
