"""``SuffixTree.add`` (its steps inlined, for speed) leaves the tree and the cursor exactly as
token-by-token ``extend`` does, through removals that free nodes and reuse them."""

from __future__ import annotations

import random

from pagoda_spec_suffix.tree import SuffixTree


def _state(tree: SuffixTree) -> tuple:
    return tree.edges, tree.count, tree.total, tree.best, tree.best_tok, tree.free


def test_add_matches_extend_token_by_token() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(40) for _ in range(2000)] + [3, 4, 5] * 50  # (and a repeat)
    fast, slow = SuffixTree(8), SuffixTree(8)
    cf: list[int] = []
    cs: list[int] = []
    for i in range(0, len(tokens), 7):
        chunk = tokens[i : i + 7]
        cf = fast.add(chunk, cf)
        for t in chunk:
            cs = slow.extend(cs, t)
        assert cf == cs
        if i in (700, 1400):  # (removals free nodes, which later additions reuse)
            fast.remove(tokens[: i // 2])
            slow.remove(tokens[: i // 2])
    assert _state(fast) == _state(slow)
    assert fast.draft(cf, 5, 0.0, 2.0) == slow.draft(cs, 5, 0.0, 2.0)
