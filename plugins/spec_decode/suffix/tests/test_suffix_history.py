"""Drafts from a request's own history (``pagoda_spec_suffix.history``) are those of a suffix
tree holding that history: the same tokens, scores and match lengths, ties broken alike."""

from __future__ import annotations

import numpy as np
import pytest
from pagoda_spec_suffix.history import history_draft, longest_match
from pagoda_spec_suffix.tree import SuffixTree


def _tree_draft(tokens, depth, longest, k, floor, factor):
    tree = SuffixTree(depth)
    tree.add(tokens)
    return tree.draft_from(tree.longest_suffix(tokens[-longest:], longest), k, floor, factor)


def _row(tokens: list[int]) -> np.ndarray:
    row = np.full(len(tokens) + 7, -1, dtype=np.int64)  # (the row runs past what is known)
    row[: len(tokens)] = tokens
    return row


@pytest.mark.parametrize("seed", range(6))
def test_the_history_drafts_what_the_tree_of_the_history_drafts(seed: int) -> None:
    rng = np.random.default_rng(seed)
    drafted = 0
    for _ in range(400):
        depth = int(rng.integers(3, 20))
        k = int(rng.integers(1, min(depth, 9)))
        # (the proposer's longest leaves room for k drafts; a longer one meets the tree's depth)
        longest = max(1, depth - k) if rng.random() < 0.5 else int(rng.integers(1, depth))
        n = int(rng.integers(1, 150))
        base = rng.integers(0, int(rng.integers(2, 12)), n)
        if rng.random() < 0.4:  # (a text that repeats itself, as a copy does)
            base = np.concatenate([base, base[: n // 2], base[: n // 3]])
        tokens = base.tolist()
        floor = float(rng.choice([0.0, 0.1, 0.3]))
        factor = float(rng.choice([0.5, 1.0, 4.0]))
        want = _tree_draft(tokens, depth, longest, k, floor, factor)
        got = history_draft(_row(tokens), len(tokens), longest, k, floor, factor, depth)
        assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-12)
        if want[0]:
            assert got[2] == want[2]
            drafted += 1
    assert drafted > 100  # (most histories draft: the comparison is not of empty drafts)


def test_many_occurrences_are_counted_alike_ties_included() -> None:
    # One token matched (depth 3, k 2): its next tokens are counted over 60 - 200 occurrences
    # (array operations); with two tokens in turn, ties are common.
    rng = np.random.default_rng(7)
    for n in (120, 200, 401):
        for vocab in (2, 3):
            tokens = rng.integers(0, vocab, n).tolist()
            want = _tree_draft(tokens, 3, 1, 2, 0.0, 4.0)
            got = history_draft(_row(tokens), n, 1, 2, 0.0, 4.0, 3)
            assert got[0] == want[0] and got[1] == pytest.approx(want[1])
    # A tie after "5" (1 and 2, twice each): the tree keeps the first to reach the top count,
    # 2 (1 came first, 2 came twice first).
    tokens = [5, 1, 5, 2, 5, 2, 5, 1, 5]
    assert _tree_draft(tokens, 4, 1, 1, 0.0, 4.0)[0] == [2]
    assert history_draft(_row(tokens), len(tokens), 1, 1, 0.0, 4.0, 4)[0] == [2]


def test_the_longest_match_is_followed_by_a_known_token() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3]
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    assert longest_match(data, len(tokens), 8, 8) == 3  # "1 2 3", followed by 9
    assert history_draft(_row(tokens), len(tokens), 8, 4, 0.0, 4.0, 16)[0] == [9, 1, 2, 3]
    # The context's own end is no earlier occurrence: a history that never repeats drafts none.
    assert history_draft(_row([4, 5, 6, 7]), 4, 8, 4, 0.0, 4.0, 16) == ([], 0.0, 0)
