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
from pagoda.spec_decode.pause import YIELD_WEIGHT as SHARED_WEIGHT
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


def _join_waiting(p: SuffixProposer, req_id: str, history: list[int], num_prompt: int) -> None:
    """Calls for one request, each followed by the runner's ``settle``, until the outputs
    waiting to join the global tree are in (a slice a call)."""
    while True:
        p.propose(_batch([req_id], [history], [num_prompt]))
        p.settle()  # (the runner's, after the launch)
        if not p._to_cache and p._caching is None:
            return


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

    def second(p: SuffixProposer) -> list[int]:
        p.propose(_batch(["a"], [[1, 2, 3, *answer]], [3]))
        p.remove(["a"])  # its output joins the global tree, a slice at each settle after a call
        _join_waiting(p, "b", [7, 8, *answer[:4]], 2)
        return p.propose(_batch(["b"], [[7, 8, *answer[:5]]], [2])).token_ids[0].tolist()

    assert second(_proposer()) == answer[5:11]
    assert second(_proposer(global_max_tokens=0)) == [-1] * 6


def test_an_output_joins_the_global_tree_a_slice_at_each_settle() -> None:
    """Added at once when its request leaves, an output would hold up the next launch; the
    first ``settle`` after each call (the runner's, after the launch) adds a slice. Drafts from
    the output's later part wait for their slice; the tree's version moves once the output is
    in (and when one is dropped), not at each slice."""
    from pagoda_spec_suffix.proposer import CACHE_SLICE

    answer = list(range(100, 100 + 3 * CACHE_SLICE + 6))  # (the fourth slice ends it)
    other = list(range(5000, 5020))
    p = _proposer()
    p.propose(_batch(["a"], [[1, 2, 3, *answer]], [3]))
    p.remove(["a"])
    assert p.global_tree.empty and not p.cached

    def step() -> None:  # (another request's call, and the runner's settle after its launch)
        p.propose(_batch(["c"], [[9, *other]], [1]))
        p.settle()
        p.settle()  # (the next launch's: no slice)

    step()
    assert p.cached_tokens == len(answer) and len(p.cached["a"]) == CACHE_SLICE  # (room kept)
    version = p.global_version
    step()  # two slices in: not yet the late part
    late = answer[2 * CACHE_SLICE : 2 * CACHE_SLICE + 2]
    assert p.global_version == version and len(p.cached["a"]) == 2 * CACHE_SLICE
    assert not p.global_tree.edges.get(late[0])  # (0 is the root: the key of the root's edge)
    step()  # the third slice: drafts from the late part, up to what is in
    got = p.propose(_batch(["b"], [[7, 8, *late]], [2])).token_ids[0].tolist()
    want = answer[2 * CACHE_SLICE + 2 : min(2 * CACHE_SLICE + 8, 3 * CACHE_SLICE)]
    assert got == want + [-1] * (6 - len(want))
    p.settle()
    assert p.global_version == version + 1 and p.cached["a"] == answer and p._caching is None
    # The same tree as the output's add at once.
    whole = SuffixTree(p.depth)
    whole.add(answer)
    assert sorted(p.global_tree.edges) == sorted(whole.edges)
    assert sorted(p.global_tree.count) == sorted(whole.count)


def test_a_slice_is_a_share_of_the_outputs_waiting() -> None:
    """Outputs that come faster than ``CACHE_SLICE`` tokens a step (many requests leaving at
    once) join in slices of ``1 / CACHE_SHARE`` of what waits, so the wait stays bounded."""
    from pagoda_spec_suffix.proposer import CACHE_SHARE, CACHE_SLICE

    p = _proposer()
    ids = [f"r{j}" for j in range(8)]
    outputs = [list(range(1000 + 250 * j, 1000 + 250 * j + 200)) for j in range(8)]
    p.propose(_batch(ids, [[1, *out] for out in outputs], [1] * 8))
    p.remove(ids)
    waiting = p._queued_tokens
    assert waiting == 1600 and waiting // CACHE_SHARE > CACHE_SLICE
    p.propose(_batch(["c"], [[9, 5000, 5001]], [1]))
    p.settle()
    assert p._queued_tokens == waiting - waiting // CACHE_SHARE


def test_outputs_waiting_to_join_the_global_tree_stay_within_its_bound() -> None:
    """Six requests leave at once: the four oldest outputs would be pushed out of the tree by
    the two newest before they are in, so they do not wait."""
    p = _proposer(global_max_tokens=50)
    ids = [f"r{j}" for j in range(6)]
    p.propose(_batch(ids, [[1, *range(1000 + 20 * j, 1020 + 20 * j)] for j in range(6)], [1] * 6))
    p.remove(ids)
    assert [r for r, _ in p._to_cache] == ["r4", "r5"] and p._queued_tokens == 40


def test_global_tree_drops_the_oldest_outputs_beyond_its_bound() -> None:
    p = _proposer(global_max_tokens=50)
    for j in range(5):
        out = list(range(1000 + 20 * j, 1020 + 20 * j))
        p.propose(_batch([f"r{j}"], [[1, *out]], [1]))
        p.remove([f"r{j}"])
    _join_waiting(p, "x", [1, 2], 1)  # (the last outputs join at the next calls' settles)
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


def test_a_record_of_accepted_drafts_carries_a_request_through_an_edit() -> None:
    # A request copies its prompt: 3 drafts accepted a step, then an edit, where 4 slot steps
    # accept none. At a slot cost of 0.3 the request keeps drafting through the edit (its mean
    # accepted drafts stays over the cost), where the shared default weight paused it.
    prompt = list(range(100, 160))

    def paused_after_the_edit(p: SuffixProposer) -> bool:
        n = 70
        for step in range(8):
            n += 4 if step < 4 else 1
            batch = _batch(["a"], [prompt + prompt[: n - 60]], [60])
            batch.slot_cost = 0.3
            assert p.propose(batch).token_ids[0, 0] >= 0  # a draft each step: no miss
            p.settle()
        return "a" in p.resume_at

    assert not paused_after_the_edit(_proposer())
    shared = _proposer()
    shared.pause.yield_weight = SHARED_WEIGHT
    assert paused_after_the_edit(shared)
