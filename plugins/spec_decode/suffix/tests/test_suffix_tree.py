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


def _follow(tree: SuffixTree, cursor: list[int], token: int, longest: int) -> list[int]:
    """The reference: every suffix of the context (length 1, 2, ..., at most ``longest``)
    that the tree holds, after ``token``, looked up level by level (``NONE`` where it holds no
    such substring; a node freed since counts as absent)."""
    from pagoda_spec_suffix.tree import _KEY, NONE

    out = [tree.edges.get(token, NONE)]
    for node in cursor[: longest - 1]:
        held = node != NONE and tree.count[node]
        out.append(tree.edges.get(node * _KEY + token, NONE) if held else NONE)
    while out and out[-1] == NONE:
        out.pop()
    return out


def test_the_longest_node_and_its_links_stand_for_the_whole_cursor() -> None:
    """``follow_longest`` keeps the last node of the level-by-level cursor, the cursor is that
    node's chain of links, and ``draft_from`` drafts what ``draft`` does: over a tree whose removals
    freed nodes that later additions reuse, for a context the tree holds in parts."""
    from pagoda_spec_suffix.tree import NONE

    rng = random.Random(1)
    seqs = [[rng.randrange(30) for _ in range(300)] for _ in range(6)]
    tree = SuffixTree(12)
    for seq in seqs[:4]:
        tree.add(seq)
    tree.remove(seqs[0])
    tree.remove(seqs[2])
    tree.add(seqs[4])
    context = seqs[1][:50] + seqs[5] + seqs[3][100:160] + seqs[0][:40]
    longest, drafted = 8, 0
    cursor: list[int] = []
    node = 0
    for t in context:
        cursor = _follow(tree, cursor, t, longest)
        node = tree.follow_longest(node, t, longest)
        assert node == (cursor[-1] if cursor else 0)
        chain, n = [], node
        while n:
            chain.append(n)
            n = tree.link[n]
        assert chain[::-1] == cursor and NONE not in cursor
        got = tree.draft_from(node, 6, 0.0, 2.0)
        assert got == tree.draft(cursor, 6, 0.0, 2.0)
        drafted += bool(got[0])
    assert drafted > 50  # (the held parts draft)
    assert node == tree.longest_suffix(context[-longest:], longest)
