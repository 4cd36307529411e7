"""A suffix tree of bounded depth over token sequences, with each substring's count.

Every substring of at most ``depth`` tokens of the sequences added is a path from the root; a
node counts the occurrences of its substring, so a node's children say what followed that
substring and how often. Adding a token costs ``depth`` steps: a *cursor* (the nodes of the
suffixes that end at the last token added, shortest first) is extended by the token. Removing a
sequence takes its counts back and frees the nodes that reach zero, so a tree over a window of
sequences stays bounded by the tokens in the window times the depth.

Drafting (:meth:`SuffixTree.draft`) starts at the node of the longest suffix of a context that
has a continuation, and follows the most frequent child while the product of the children's
frequencies (each child's count over its siblings' total) stays above a floor: a substring
always followed by the same tokens drafts long, one with many continuations short or not at all.

Each node also keeps its length and its *suffix link* (the node of its substring without the
first token), so that a context's suffixes the tree holds are one node, the longest, and its
chain of links: :meth:`SuffixTree.follow_longest` moves that node past a token in a lookup or
two (amortised) where following the whole cursor looks up every level, and
:meth:`SuffixTree.draft_from` drafts from it as :meth:`SuffixTree.draft` from the whole cursor.
A node's link outlives it: every occurrence of a substring is one of its suffix, so the suffix's
count is never the lower and a removal frees it no sooner.

NOTE: nodes are integers and edges one dictionary of integer keys (``node * 2**24 + token``),
so that a tree of hundreds of thousands of nodes holds no Python object the garbage collector
tracks (a tree of node objects spent most of its time in collections). Each node keeps its most
frequent child (updated as counts grow; after a removal it may be stale until the next addition
there: drafts may then follow a child that is no longer the most frequent, which costs
acceptance, never correctness).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

_KEY = 1 << 24  # tokens are below this
NONE = -1


class SuffixTree:
    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"suffix tree: depth must be at least 2, got {depth}")
        self.depth = depth
        self.edges: dict[int, int] = {}  # node * _KEY + token -> child
        self.count: list[int] = [0]  # per node; node 0 is the root
        self.total: list[int] = [0]  # per node: its children's counts summed
        self.best: list[int] = [NONE]  # per node: its most frequent child
        self.best_tok: list[int] = [NONE]
        self.length: list[int] = [0]  # per node: its substring's length
        self.link: list[int] = [0]  # per node: its substring's without the first token
        self.free: list[int] = []

    @property
    def empty(self) -> bool:
        return self.total[0] == 0

    def _child(self, node: int, token: int, link: int) -> int:
        key = node * _KEY + token
        child = self.edges.get(key)
        if child is None:
            if self.free:
                child = self.free.pop()
                self.count[child] = self.total[child] = 0
                self.best[child] = self.best_tok[child] = NONE
                self.length[child], self.link[child] = self.length[node] + 1, link
            else:
                child = len(self.count)
                self.count.append(0)
                self.total.append(0)
                self.best.append(NONE)
                self.best_tok.append(NONE)
                self.length.append(self.length[node] + 1)
                self.link.append(link)
            self.edges[key] = child
        c = self.count[child] = self.count[child] + 1
        self.total[node] += 1
        b = self.best[node]
        if b == NONE or (b != child and c > self.count[b]):
            self.best[node], self.best_tok[node] = child, token
        return child

    def extend(self, cursor: list[int], token: int) -> list[int]:
        """Add ``token`` after the suffixes ``cursor`` (shortest first, as this returns):
        each of them, and the empty one, gains it. Returns the new cursor."""
        new: list[int] = []
        for node in (0, *cursor[: self.depth - 1]):
            new.append(self._child(node, token, new[-1] if new else 0))
        return new

    def add(self, tokens: Iterable[int], cursor: list[int] | None = None) -> list[int]:
        """:meth:`extend` by each of ``tokens`` in turn (from ``cursor``, default the empty
        context); returns the last cursor. The same steps as :meth:`_child`'s, inlined: this
        runs for every token a request gains, ``depth`` steps each, on the host's critical path
        at batch 1 (a verification that accepts 8 drafts adds 9 tokens: some 290 steps)."""
        cursor = [] if cursor is None else cursor
        edges, count, total, best, best_tok, length, link = (
            self.edges, self.count, self.total, self.best, self.best_tok, self.length, self.link
        )  # fmt: skip
        free, keep = self.free, self.depth - 1
        for t in tokens:
            new = []
            for node in (0, *cursor[:keep]):
                key = node * _KEY + t
                child = edges.get(key)
                if child is None:
                    if free:
                        child = free.pop()
                        count[child] = total[child] = 0
                        best[child] = best_tok[child] = NONE
                        length[child], link[child] = length[node] + 1, new[-1] if new else 0
                    else:
                        child = len(count)
                        count.append(0)
                        total.append(0)
                        best.append(NONE)
                        best_tok.append(NONE)
                        length.append(length[node] + 1)
                        link.append(new[-1] if new else 0)
                    edges[key] = child
                c = count[child] = count[child] + 1
                total[node] += 1
                b = best[node]
                if b == NONE or (b != child and c > count[b]):
                    best[node], best_tok[node] = child, t
                new.append(child)
            cursor = new
        return cursor

    def build(self, tokens: Sequence[int]) -> list[int]:
        """:meth:`add` of ``tokens`` to an empty tree, in array operations: the same substrings,
        counts, totals, lengths and links (node numbers aside; a most frequent child among
        equals is the first in token order). Returns the cursor :meth:`add` would.

        NOTE: a request's prompt joins its tree at the request's first call, on the host's
        critical path: :meth:`add` of 600 tokens takes some 19,000 dictionary steps (7 ms of
        an H200 host's time); this sorts the prompt's suffixes once and numbers each level's
        distinct substrings from the sorted order (``benchmarks/suffix_proposer.py``)."""
        if not self.empty or len(self.count) > 1:
            return self.add(tokens)
        n, depth = len(tokens), self.depth
        if n == 0:
            return []
        t = np.asarray(tokens, dtype=np.int64)
        # Each start's window of ``depth`` tokens; past the end, a value of its own below every
        # token, so that no two windows match there.
        idx = np.arange(n)[:, None] + np.arange(depth)[None, :]
        windows = np.where(idx < n, t[np.minimum(idx, n - 1)], -1 - np.arange(n)[:, None])
        order = np.lexsort(windows.T[::-1])  # starts by their windows, in order
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        w = windows[order]
        # The tokens each window shares with the one before it in that order.
        same = np.cumprod(w[1:] == w[:-1], axis=1).sum(axis=1)
        shared = np.concatenate(([-1], same))
        levels = min(depth, n)
        length = np.arange(1, levels + 1)
        # Level by level (columns), in the windows' order (rows): whether the window reaches the
        # level, and whether it is its substring's first window there.
        valid = (n - order)[:, None] >= length[None, :]
        start = valid & (shared[:, None] < length[None, :])
        firsts = start.sum(axis=0)
        base = 1 + np.concatenate(([0], np.cumsum(firsts)[:-1]))
        # Each window's node at each level (0: none, and the root before the first level).
        nodes = np.zeros((n, levels + 1), dtype=np.int64)
        nodes[:, 1:] = np.where(valid, base[None, :] + np.cumsum(start, axis=0) - 1, 0)
        lvl, row = np.nonzero(start.T)  # every node once, in node order (level, then row)
        parent = nodes[row, lvl]
        token = w[row, lvl]
        count = np.bincount(nodes[:, 1:][valid], minlength=int(base[-1] + firsts[-1]))[1:]
        # A node's link: its substring without the first token, the next start's a level up.
        after = rank[np.minimum(order[row] + 1, n - 1)]
        link = np.where(lvl > 0, nodes[after, lvl], 0)
        size = len(count) + 1  # nodes, the root included
        total = np.bincount(parent, weights=count, minlength=size).astype(np.int64)
        node = np.arange(1, size)
        # A parent's children are neighbours in node order (their windows share its prefix,
        # and follow each other in the windows' order, by token): its most frequent child is
        # the first of its run of children with the run's greatest count.
        first = np.flatnonzero(np.r_[True, parent[1:] != parent[:-1]])
        most = np.repeat(np.maximum.reduceat(count, first), np.diff(np.r_[first, len(count)]))
        head = np.minimum.reduceat(np.where(count == most, np.arange(len(count)), size), first)
        best = np.full(size, NONE, dtype=np.int64)
        best_tok = np.full(size, NONE, dtype=np.int64)
        best[parent[head]], best_tok[parent[head]] = node[head], token[head]
        self.edges = dict(zip((parent * _KEY + token).tolist(), node.tolist()))
        self.count = [0, *count.tolist()]
        self.total = total.tolist()
        self.best, self.best_tok = best.tolist(), best_tok.tolist()
        self.length = [0, *(lvl + 1).tolist()]
        self.link = [0, *link.tolist()]
        self.free = []
        last = n - 1 - np.arange(levels)  # the starts of the whole's suffixes, shortest first
        return nodes[rank[last], length].tolist()

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back the counts that :meth:`add` of ``tokens`` (in one call) put in."""
        n, edges, count, total = len(tokens), self.edges, self.count, self.total
        for start in range(n):
            node = 0
            for j in range(start, min(n, start + self.depth)):
                key = node * _KEY + tokens[j]
                child = edges.get(key)
                if child is None:  # (not added as one sequence: nothing more to take back)
                    break
                count[child] -= 1
                total[node] -= 1
                if count[child] <= 0:
                    del edges[key]
                    count[child] = 0
                    self.free.append(child)
                    if self.best[node] == child:
                        self.best[node] = self.best_tok[node] = NONE
                node = child

    def follow_longest(self, node: int, token: int, longest: int) -> int:
        """The node of the longest suffix (at most ``longest`` tokens) of a context that the
        tree holds, after ``token``, from that node before it (0: none held). A suffix's
        extension is looked up from the longest suffix down its links, the first held wins: a
        lookup or two a token, amortised, where following every suffix takes one a level.
        ``node`` must be live (not freed since: :meth:`longest_suffix` again)."""
        edges, count, length, link = self.edges, self.count, self.length, self.link
        while True:
            if length[node] < longest:
                child = edges.get(node * _KEY + token)
                if child is not None and count[child]:
                    return child
            if node == 0:
                return 0
            node = link[node]

    def longest_suffix(self, tokens: Iterable[int], longest: int) -> int:
        """The node of the longest suffix (at most ``longest`` tokens) of ``tokens`` that the
        tree holds (0: none); only the last ``longest`` tokens matter."""
        node = 0
        for t in tokens:
            node = self.follow_longest(node, t, longest)
        return node

    def draft_from(
        self, node: int, max_len: int, min_prob: float, factor: float
    ) -> tuple[list[int], float, int]:
        """:meth:`draft` from the cursor whose longest node is ``node`` (the rest being its
        chain of links)."""
        count, total, best, link = self.count, self.total, self.best, self.link
        while node:
            if count[node] and total[node] and best[node] != NONE:
                return self._draft(node, self.length[node], max_len, min_prob, factor)
            node = link[node]
        return [], 0.0, 0

    def _draft(
        self, node: int, m: int, max_len: int, min_prob: float, factor: float
    ) -> tuple[list[int], float, int]:
        count, total, best, best_tok = self.count, self.total, self.best, self.best_tok
        limit = min(max_len, max(1, int(factor * m)))
        out: list[int] = []
        prob = 1.0
        score = 0.0
        while len(out) < limit and total[node] and best[node] != NONE:
            child = best[node]
            prob *= count[child] / total[node]
            if prob < min_prob:
                break
            out.append(best_tok[node])
            score += prob
            node = child
        return out, score, m

    def draft(
        self, cursor: Sequence[int], max_len: int, min_prob: float, factor: float
    ) -> tuple[list[int], float, int]:
        """The draft from the longest suffix in ``cursor`` with a continuation: (tokens, their
        expected accepted count (the sum of each prefix's probability), the suffix's length).
        At most ``max_len`` tokens and ``factor`` times the suffix's length."""
        count, total, best = self.count, self.total, self.best
        for m in range(len(cursor), 0, -1):
            node = cursor[m - 1]
            if node == NONE or not count[node] or not total[node] or best[node] == NONE:
                continue
            return self._draft(node, m, max_len, min_prob, factor)
        return [], 0.0, 0
