"""``SuffixTree.add`` (its steps inlined, for speed) leaves the tree and the cursor exactly as
token-by-token ``extend`` does, through removals that free nodes and reuse them."""

from __future__ import annotations

import random

import numpy as np
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


def _canonical(tree: SuffixTree, cursor: list[int], strict: bool = True) -> tuple:
    """The tree by substrings (node numbers aside): each substring's count, total, length,
    link (as a substring) and its most frequent child's count; and the cursor's
    substrings. ``strict``: each node's most frequent child is one of greatest count (after a
    removal it may be stale, and a link or a best child may be a freed node: "-")."""
    from pagoda_spec_suffix.tree import _KEY, NONE

    text = {0: ()}
    for key, child in sorted(tree.edges.items(), key=lambda kv: tree.length[kv[1]]):
        text[child] = (*text[key // _KEY], key % _KEY)
    nodes = {
        text[v]: (
            tree.count[v],
            tree.total[v],
            tree.length[v],
            text.get(tree.link[v], "-"),
            None if tree.best[v] == NONE else text.get(tree.best[v], "-"),
        )
        for v in text
        if v
    }
    if strict:
        most: dict[tuple, int] = {}
        for key, child in tree.edges.items():
            parent = text[key // _KEY]
            most[parent] = max(most.get(parent, 0), tree.count[child])
        for s, (_, total, _, _, best) in nodes.items():
            assert (total == 0) == (s not in most)
            assert best is None if total == 0 else nodes[best][0] == most[s]
            if best is not None:
                assert tree.best_tok[_key(tree, s)] == best[-1]
    # (which of equally frequent children is the most frequent one may differ: its count not)
    nodes = {s: (*v[:4], v[4] if v[4] in (None, "-") else nodes[v[4]][0]) for s, v in nodes.items()}
    return nodes, [text[c] for c in cursor]


def _key(tree: SuffixTree, s: tuple) -> int:
    from pagoda_spec_suffix.tree import _KEY

    node = 0
    for t in s:
        node = tree.edges[node * _KEY + t]
    return node


def test_build_of_a_prompt_matches_adding_it() -> None:
    rng = random.Random(1)
    for n, depth, vocab in ((1, 4, 5), (3, 8, 2), (300, 8, 6), (700, 32, 40), (50, 64, 3)):
        tokens = [rng.randrange(vocab) for _ in range(n)]
        tokens += tokens[n // 3 : n // 3 + n // 4]  # (a repeat, as a copy task's prompt has)
        built, added = SuffixTree(depth), SuffixTree(depth)
        cb, ca = built.build(tokens), added.add(tokens)
        assert _canonical(built, cb) == _canonical(added, ca)
        assert built.draft(cb, 8, 0.0, 2.0) == added.draft(ca, 8, 0.0, 2.0)
        more = [rng.randrange(vocab) for _ in range(40)]  # and both grow alike after it
        assert _canonical(built, built.add(more, cb)) == _canonical(added, added.add(more, ca))
        built, added = SuffixTree(depth), SuffixTree(depth)  # and shrink alike
        built.build(tokens)
        added.add(tokens)
        built.remove(tokens)
        added.remove(tokens)
        assert _canonical(built, [], False) == _canonical(added, [], False) == ({}, [])


def test_the_longest_suffix_of_a_context_is_its_last_tokens_alone() -> None:
    """Followed token by token from the start of a long context or from its last ``longest``
    tokens only, the walk ends at the same node (the proposer finds a prompt's node in the
    global tree from the prompt's end)."""
    rng = np.random.default_rng(3)
    tree = SuffixTree(12)
    for _ in range(6):
        tree.add(rng.integers(0, 6, 80).tolist())
    for longest in (3, 8):
        for _ in range(50):
            context = rng.integers(0, 6, 200).tolist()
            whole = tree.longest_suffix(context, longest)
            assert whole == tree.longest_suffix(context[-longest:], longest)
            assert tree.length[whole] <= longest
