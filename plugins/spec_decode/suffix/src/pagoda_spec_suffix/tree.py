"""A suffix tree of bounded depth over token sequences, with each substring's count.

Every substring of at most ``depth`` tokens of the sequences added is a path from the root; a
node counts the occurrences of its substring, so a node's children say what followed that
substring and how often. Adding a token costs ``depth`` steps: a *cursor* (the nodes of the
suffixes that end at the last token added, shortest first) is extended by the token. Removing a
sequence takes its counts back and drops the nodes that reach zero, so a tree over a window of
sequences stays bounded by the tokens in the window times the depth.

Drafting (:meth:`SuffixTree.draft`) starts at the node of the longest suffix of a context that
has a continuation, and follows the most frequent child while the product of the children's
frequencies (each child's count over its siblings') stays above a floor: a substring always
followed by the same tokens drafts long, one with many continuations short or not at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, Node] = {}
        self.count = 0

    def best_child(self) -> tuple[int, Node, int]:
        """(token, node, total of the children's counts) of the most frequent child."""
        total = 0
        best_tok, best = -1, None
        for tok, child in self.children.items():
            total += child.count
            if best is None or child.count > best.count:
                best_tok, best = tok, child
        return best_tok, best, total  # type: ignore[return-value]


class SuffixTree:
    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"suffix tree: depth must be at least 2, got {depth}")
        self.depth = depth
        self.root = Node()

    def extend(self, cursor: list[Node], token: int) -> list[Node]:
        """Add ``token`` after the suffixes ``cursor`` (shortest first, as this returns):
        each of them, and the empty one, gains it. Returns the new cursor."""
        out = []
        for node in (self.root, *cursor[: self.depth - 1]):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
            child.count += 1
            out.append(child)
        return out

    def add(self, tokens: Iterable[int], cursor: list[Node] | None = None) -> list[Node]:
        cursor = [] if cursor is None else cursor
        for t in tokens:
            cursor = self.extend(cursor, t)
        return cursor

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back the counts that :meth:`add` of ``tokens`` (in one call) put in."""
        n = len(tokens)
        for start in range(n):
            node = self.root
            for j in range(start, min(n, start + self.depth)):
                child = node.children.get(tokens[j])
                if child is None:  # (not added as one sequence: nothing more to take back)
                    break
                child.count -= 1
                if child.count <= 0:
                    del node.children[tokens[j]]
                    child.count = 0  # NOTE: cursors that still hold it see a dead node
                node = child

    def follow(self, cursor: list[Node | None], token: int, longest: int) -> list[Node | None]:
        """Like :meth:`extend` without adding: the nodes of the suffixes (length 1, 2, ...,
        at most ``longest``) of a context that the tree holds, after ``token``; None where it
        holds no such substring. For a context kept apart from the tree (another request's)."""
        out: list[Node | None] = [self.root.children.get(token)]
        for node in cursor[: longest - 1]:
            out.append(node.children.get(token) if node is not None and node.count else None)
        while out and out[-1] is None:
            out.pop()
        return out

    @staticmethod
    def draft(
        cursor: Sequence[Node | None], max_len: int, min_prob: float, factor: float
    ) -> tuple[list[int], float, int]:
        """The draft from the longest suffix in ``cursor`` with a continuation: (tokens, their
        expected accepted count (the sum of each prefix's probability), the suffix's length).
        At most ``max_len`` tokens and ``factor`` times the suffix's length."""
        for m in range(len(cursor), 0, -1):
            node = cursor[m - 1]
            if node is None or not node.count or not node.children:
                continue
            limit = min(max_len, max(1, int(factor * m)))
            out: list[int] = []
            prob = score = 1.0
            score = 0.0
            while len(out) < limit and node.children:
                tok, child, total = node.best_child()
                prob *= child.count / total
                if prob < min_prob:
                    break
                out.append(tok)
                score += prob
                node = child
            return out, score, m
        return [], 0.0, 0
