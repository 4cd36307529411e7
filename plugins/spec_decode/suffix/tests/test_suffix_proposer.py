"""The suffix tree and the proposer on synthetic histories: drafts follow the most frequent
continuation, stop where it becomes uncertain, come from other requests' outputs through the
global tree, and the global tree stays within its bound."""

from __future__ import annotations

import numpy as np
import pytest
from pagoda_spec_suffix.proposer import SuffixProposer
from pagoda_spec_suffix.tree import SuffixTree

from pagoda.config import SpeculativeConfig
from pagoda.spec_decode import ProposalBatch
from pagoda.testing.spec_decode import make_context


def _proposer(**settings) -> SuffixProposer:
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=6)
    cfg._plugin_values = {"suffix": settings} if settings else {}  # type: ignore[attr-defined]
    return SuffixProposer(make_context(cfg))


def _batch(req_ids: list[str], histories: list[list[int]], num_prompt: list[int]):
    ids = np.full((10, 300), -1, dtype=np.int64)
    for r, h in enumerate(histories):
        ids[r, : len(h)] = h
    n = len(req_ids)
    return ProposalBatch(
        req_ids=req_ids,
        rows=np.arange(n, dtype=np.int64),
        token_ids=ids,
        num_tokens=np.array([len(h) for h in histories], dtype=np.int64),
        num_prompt_tokens=np.array(num_prompt, dtype=np.int64),
        max_num_drafts=np.full(n, 6, dtype=np.int64),
    )


def test_draft_follows_the_most_frequent_continuation_and_stops_when_unsure() -> None:
    tree = SuffixTree(8)
    cursor = tree.add([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2])
    draft, score, matched = tree.draft(cursor, 6, 0.3, 4.0)
    # "1 2" was followed by "3" three times; after "1 2 3", "4" twice and "5" once.
    assert matched == 2 and draft[:2] == [3, 4]
    assert score > 1.0
    unsure = tree.draft(cursor, 6, 0.9, 4.0)[0]
    assert unsure == [3]


def test_second_request_repeating_an_earlier_answer_drafts_it_from_the_global_tree() -> None:
    answer = list(range(100, 140))
    p = _proposer()
    p.propose(_batch(["a"], [[1, 2, 3, *answer]], [3]))
    p.remove(["a"])  # its output joins the global tree
    got = p.propose(_batch(["b"], [[7, 8, *answer[:5]]], [2])).token_ids[0]
    assert got.tolist() == answer[5:11]
    off = _proposer(global_max_tokens=0)
    off.propose(_batch(["a"], [[1, 2, 3, *answer]], [3]))
    off.remove(["a"])
    assert (off.propose(_batch(["b"], [[7, 8, *answer[:5]]], [2])).token_ids[0] == -1).all()


def test_global_tree_drops_the_oldest_outputs_beyond_its_bound() -> None:
    p = _proposer(global_max_tokens=50)
    for j in range(5):
        out = list(range(1000 + 20 * j, 1020 + 20 * j))
        p.propose(_batch([f"r{j}"], [[1, *out]], [1]))
        p.remove([f"r{j}"])
    assert p.cached_tokens <= 50 and list(p.cached) == ["r3", "r4"]
    # The oldest output's substrings are gone from the tree; the newest are there.
    tree = p.global_tree
    assert 1000 not in tree.edges and tree.count[tree.edges[1080]] == 1
    # Nodes freed by the dropped outputs are reused: the tree holds what its window holds.
    assert len(tree.count) - len(tree.free) - 1 == len(tree.edges)


def test_the_time_between_requests_is_not_a_step() -> None:
    """Requests one after another (batch 1): the time from one's last call, which gave drafts,
    to the next one's first holds the next one's prefill, not a step of those drafts."""
    text = np.random.default_rng(0).integers(0, 200, 25).tolist() * 10

    def threshold(gap: float) -> float:
        p = _proposer()
        clock = [0.0]
        p.cost.clock = lambda: clock[0]
        given = 0
        for r in range(8):
            clock[0] += gap
            for step in range(12):
                clock[0] += 0.1 + 0.001 * given
                batch = _batch([f"req{r}"], [text[: 60 + 6 * step]], [50])
                batch.max_num_drafts[:] = 1 + step % 6  # (counts that vary, 6 at the last)
                got = p.propose(batch)
                given = int((got.token_ids[0] >= 0).sum())
            assert given == 6
            p.remove([f"req{r}"])
        assert p.cost.fits[1].fit() is not None
        return p.cost.threshold(1)

    assert threshold(0.15) == pytest.approx(threshold(0.0), rel=1e-9)
