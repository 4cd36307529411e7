"""Drafts from a request's own tokens, read from its history where a tree would be kept.

A request's own suffix tree (``SuffixTree`` over its prompt and output) answers one question
per call: after the longest suffix of the context that occurred before with a continuation,
which tokens followed, and how often. :func:`history_draft` answers it from the request's token
row itself, with the counts a tree of depth ``depth`` holding the whole history would give
(``tests``: the same drafts, scores and match lengths as ``SuffixTree.draft_from`` on such a
tree, ties included): the suffix by a binary search of byte searches (a suffix that occurs
earlier has every shorter suffix occur there too), its earlier occurrences by byte searches, and
the draft by following the most frequent next token among those occurrences, narrowing them
at each token.

NOTE: a tree costs its upkeep at every token: ``depth`` dictionary steps each (on an H200's
host at batch 1, the copy set: 0.45 ms of the proposer's bookkeeping a step with drafts, 0.97
ms at the steps that added a prompt's slice, some 16% of the run), all of it on the host's
critical path while steps are host-bound. A search costs nothing between calls and some tens
of microseconds a call, over the few thousand tokens a request holds.
"""

from __future__ import annotations

import numpy as np

# Above this many occurrences of the matched suffix the next tokens are counted in array
# operations; below, Python lists are cheaper (a numpy call on a few elements costs more than
# a loop over them: on a 2-core EPYC a call took 84 us over the copy set's calls with arrays
# throughout, 17 with lists and a single occurrence's continuation sliced at once).
_ARRAY_FROM = 32


def _rfind_aligned(data: bytes, sub: bytes, stop: int, size: int) -> int:
    """The byte offset of the last occurrence of ``sub`` in ``data[:stop]`` that starts on a
    token boundary (a multiple of ``size``), or -1."""
    while stop >= len(sub):
        at = data.rfind(sub, 0, stop)
        if at < 0 or at % size == 0:
            return at
        stop = at + len(sub) - 1  # a match straddling tokens: look further left
    return -1


def _ends(data: bytes, sub: bytes, stop: int, size: int) -> list[int]:
    """The token index of the last token of each occurrence of ``sub`` within ``data[:stop]``
    that starts on a token boundary, in order."""
    out, n = [], len(sub)
    at = data.find(sub, 0, stop)
    while at >= 0:
        if at % size == 0:
            out.append((at + n) // size - 1)
            at = data.find(sub, at + size, stop)
        else:
            at = data.find(sub, at + 1, stop)
    return out


def _most_frequent(tokens: list[int]) -> tuple[int, int]:
    """The most frequent token and its count, among equals the first to reach that count (the
    tree's rule, whose counts grow in the tokens' order)."""
    counts: dict[int, int] = {}
    best, best_count = tokens[0], 0
    for t in tokens:
        c = counts[t] = counts.get(t, 0) + 1
        if t == best:
            best_count = c
        elif c > best_count:
            best, best_count = t, c
    return best, best_count


def longest_match(data: bytes, num: int, longest: int, size: int) -> int:
    """The length of the longest suffix of the history's ``num`` tokens (``data``, their bytes),
    at most ``longest`` tokens, that occurs earlier followed by a token (0: none)."""
    stop = (num - 1) * size  # (an occurrence that ends at token num - 2 at the latest)
    lo, hi = 0, min(longest, num - 1)
    while lo < hi:  # (occurring is monotone in the length: binary search)
        mid = (lo + hi + 1) // 2
        if _rfind_aligned(data, data[(num - mid) * size :], stop, size) >= 0:
            lo = mid
        else:
            hi = mid - 1
    return lo


def history_draft(
    row: np.ndarray,
    num: int,
    longest: int,
    max_len: int,
    min_prob: float,
    factor: float,
    depth: int,
) -> tuple[list[int], float, int]:
    """The draft that ``SuffixTree.draft_from`` would give from a tree of depth ``depth``
    holding the history ``row[:num]``, from the node of its longest suffix of at most
    ``longest`` tokens: (tokens, their expected accepted count, the matched suffix's length)."""
    if num < 2:
        return [], 0.0, 0
    hist = row[:num]
    size = hist.itemsize
    data = hist.tobytes()
    m = longest_match(data, num, longest, size)
    if m == 0:
        return [], 0.0, 0
    # Where each occurrence's next token is (all known: they end before num - 1): an array
    # while there are many, a list once few are left.
    if m == 1:
        ends = np.flatnonzero(hist[: num - 1] == hist[num - 1])
        big = len(ends) > _ARRAY_FROM
        at = ends + 1 if big else [e + 1 for e in ends.tolist()]
    else:
        found = _ends(data, data[(num - m) * size :], (num - 1) * size, size)
        big = len(found) > _ARRAY_FROM
        at = np.asarray(found) + 1 if big else [e + 1 for e in found]
    limit = min(max_len, max(1, int(factor * m)), depth - m)
    out: list[int] = []
    prob, score = 1.0, 0.0
    item = hist.item
    while len(out) < limit:
        if big:
            nxt = hist[at]
            values, counts = np.unique(nxt, return_counts=True)
            top = counts.max()
            if (counts == top).sum() > 1:  # (ties: the tree's rule, in order)
                tok, c = _most_frequent(nxt.tolist())
            else:
                tok, c = int(values[counts.argmax()]), int(top)
        elif len(at) == 1:
            # One occurrence (a copy, mostly): its continuation, up to the known tokens, each
            # at the probability so far (the tree's counts: one of one at each token).
            if prob < min_prob:
                break
            p = at[0]
            for t in hist[p : min(p + limit - len(out), num)].tolist():
                out.append(t)
                score += prob
            break
        else:
            nxt_l = [item(p) for p in at]
            tok, c = _most_frequent(nxt_l)
        prob *= c / len(at)
        if prob < min_prob:
            break
        out.append(tok)
        score += prob
        if big:
            at = at[nxt == tok] + 1
            at = at[at < num]  # (those followed by a known token)
            if len(at) <= _ARRAY_FROM:
                big, at = False, at.tolist()
        else:
            at = [p + 1 for p, t in zip(at, nxt_l) if t == tok and p + 1 < num]
        if not len(at):
            break
    return out, score, m
