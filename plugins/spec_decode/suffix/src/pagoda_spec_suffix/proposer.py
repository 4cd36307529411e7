"""Suffix decoding: drafts from a suffix tree over the request's own tokens and from a global
tree over the recent outputs of other requests (after SuffixDecoding, Oliaro et al., 2024).

Each request keeps a tree of its prompt and output (:class:`~pagoda_spec_suffix.tree.SuffixTree`,
grown by the tokens each call brings) and its cursors in both trees: the nodes of its context's
suffixes. A request's output goes into the global tree once the request leaves (``remove``),
a slice at each ``settle`` after a call (:meth:`SuffixProposer._cache_slice`); the global tree
holds at most ``global_max_tokens`` output tokens, the oldest request's dropped
first. Each call drafts from whichever tree expects more accepted tokens, following the most
frequent continuation of the longest suffix matched while its estimated probability holds
(at least ``min_token_prob``, and at least what a draft token costs at this batch size, measured:
:class:`pagoda.spec_decode.DraftCost`) and for at most ``max_spec_factor`` times the match's
length: the draft length adapts to how often, and how consistently, the context was seen
before. With
``num_speculative_tokens`` unset drafts are at most 8 tokens long. A request that keeps getting
no draft pauses between probes (``pagoda.spec_decode.pause``: its steps then launch without
waiting for the step in flight); its tokens are caught up on at the next call.

The work per call is a few dictionary steps per new token and per tree level (``max_tree_depth``)
in Python, for each request of the batch. Adding a request's new tokens to its tree is left to
``settle`` (after the step these drafts are for is launched); a call only follows them through
the tree as it stands, from the context's longest suffix the tree holds down its suffix links,
a lookup or two a token (``benchmarks/suffix_proposer.py``). A prompt is built into its tree at
the request's first call up to ``PROMPT_FIRST`` tokens; the rest joins a slice at each
``settle`` after a call, as outputs join the global tree.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from pagoda.config import SpeculativeConfig
from pagoda.spec_decode import (
    DraftCost,
    DraftPause,
    Drafts,
    ProposalBatch,
    ProposerContext,
    SpeculativeProposer,
)
from pagoda_spec_suffix.settings import SuffixSettings
from pagoda_spec_suffix.tree import SuffixTree

# Output tokens of requests that left that a ``settle`` adds to the global tree. On an H200's
# host an output's 128 tokens took 3.6 ms at once (a prompt's 600, about 7): 24 take at most
# about the 0.65 ms that a batch-1 verifying step of SmolLM2-135M waits for the device
# (``benchmarks/README.md``).
CACHE_SLICE = 24
# A prompt's first tokens are built into its request's tree at the request's first call (in
# array operations, ``SuffixTree.build``: 128 tokens about 2 ms of a CPU core's time, 600 about
# 12); the rest joins it a slice at each ``settle`` after a call, while the device computes the
# step just launched: ``PROMPT_SLICE`` tokens (about 0.4 ms of an H200 host's time, within the
# 0.65 ms a batch-1 verifying step of SmolLM2-135M waits for the device), or an eighth of the
# rest of a longer prompt. A request copying its prompt gains a few tokens a step; its prompt
# joins the tree 32 a step, ahead of it. Until its prompt is in, a request is not paused for
# finding no draft (``DraftPause``): it would not be asked, and its settles would add nothing.
PROMPT_FIRST = 128
PROMPT_SLICE = 32
PROMPT_SLICES = 8


@dataclass
class _Request:
    tree: SuffixTree
    num_prompt: int
    tokens: list[int] = field(default_factory=list)  # known so far, a copy
    cursor: list[int] = field(default_factory=list)  # its suffixes' nodes in its own tree
    # The last tokens of ``tokens``, not yet in its tree (``settle`` adds them), and the node of
    # the longest suffix (of at most ``max_tree_depth - k`` tokens: room for a draft) of the
    # context that the tree holds without them; the shorter ones are its links.
    pending: list[int] = field(default_factory=list)
    draft_node: int = 0
    # While ``pending`` holds prompt tokens past ``PROMPT_FIRST``: how many join the tree at
    # each settle after a call (0: none held back).
    backlog: int = 0
    global_node: int = 0  # the same in the global tree
    global_version: int = -1  # the global tree's version that ``global_node`` is of


def _longest_node(cursor: list[int], longest: int) -> int:
    """The node of the longest suffix of at most ``longest`` tokens in a cursor of
    :meth:`SuffixTree.add` (the nodes of lengths 1, 2, ...; 0 where it is empty)."""
    return cursor[min(len(cursor), longest) - 1] if cursor else 0


class SuffixProposer(SpeculativeProposer):
    proposes_on_host = True  # (history on the host only: drafts may come late)

    @classmethod
    def paces_itself(cls, config: SpeculativeConfig) -> bool:
        """Its drafts stop where their probability falls below what a draft token costs."""
        return True

    def __init__(self, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        s = ctx.plugin_settings("suffix")
        self.settings: SuffixSettings = s  # type: ignore[assignment]
        self.k = ctx.num_speculative_tokens
        self.depth = s.max_tree_depth
        # The longest match drafted from: it must leave room in the tree's depth for the draft.
        self.longest = max(1, self.depth - self.k)
        self.requests: dict[str, _Request] = {}
        self.global_tree = SuffixTree(self.depth)
        # req_id -> output tokens in the global tree, oldest first; and their total.
        self.cached: OrderedDict[str, list[int]] = OrderedDict()
        self.cached_tokens = 0
        self.global_version = 0  # counts the global tree's changes
        self.cost = DraftCost()
        self.pause = DraftPause(self.resume_at)
        self._given: tuple | None = None  # the last call's, until ``settle`` records it
        self._pending: list[_Request] = []  # requests whose new tokens ``settle`` adds
        # Outputs of requests that left, waiting to join the global tree (``_cache_slice``), and
        # the one joining it: (req_id, output, the tree's cursor after the tokens added, which
        # are ``cached[req_id]``).
        self._to_cache: deque[tuple[str, list[int]]] = deque()
        self._caching: tuple[str, list[int], list[int] | None] | None = None
        self._queued_tokens = 0  # of those outputs, not yet in the tree
        self._slice_due = False  # a call since the last ``settle``

    def propose(self, batch: ProposalBatch) -> Drafts:
        self.settle()  # (the last call's bookkeeping, where the runner did not ask for it)
        self._slice_due = True
        n, k = len(batch), self.k
        out = np.full((n, k), -1, dtype=np.int64)
        s = self.settings
        longest = self.longest
        use_global = bool(self.cached)
        # A draft token must be likelier to be accepted than what it costs (measured).
        floor = max(s.min_token_prob, self.cost.threshold(n))
        gained, known, given = 0, 0, 0
        for i, req_id in enumerate(batch.req_ids):
            req, new = self._catch_up(req_id, batch, i, longest)
            if new is not None:
                gained, known = gained + new, known + 1
            cap = int(min(k, batch.max_num_drafts[i]))
            best, score, _ = req.tree.draft_from(req.draft_node, cap, floor, s.max_spec_factor)
            if use_global:
                got, g_score, _ = self.global_tree.draft_from(
                    req.global_node, cap, floor, s.max_spec_factor
                )
                if g_score > score:
                    best = got
            out[i, : len(best)] = best
            given += len(best)
        # NOTE: with a request paused at the last call, steps may have run since without one;
        # with a request new to it, the time since holds the gap between requests.
        contiguous = known == n and not self.pause.paused
        # The step's timing and the pauses are recorded in ``settle``: after the launch these
        # drafts are for, off the host's critical path.
        gained = gained / known if known else None
        found = out[:, 0] >= 0
        self._given = (n, given, gained, contiguous, batch.req_ids, batch.num_tokens, found,
                       batch.slot_cost)  # fmt: skip
        return Drafts(out)

    def settle(self) -> None:
        """Add the last call's new tokens to their requests' trees, and a slice of the outputs
        waiting to join the global tree (at the first ``settle`` after a call, at least
        ``CACHE_SLICE`` tokens and a quarter of those waiting, so that the wait stays bounded
        when outputs come faster); record the last call's step time and its requests'
        pauses."""
        due = self._slice_due
        if due:
            # (the first settle since a call: the runner's, after the launch of that call's
            # drafts; later ones, at the next launch's start, are on the host's critical path)
            self._slice_due = False
            if self._to_cache or self._caching is not None:
                self._cache_slice(max(CACHE_SLICE, self._queued_tokens // 4))
        if self._pending:
            self._pending = [req for req in self._pending if self._add_pending(req, due)]
        if self._given is None:
            return
        n, given, gained, contiguous, req_ids, num_tokens, found, slot_cost = self._given
        self._given = None
        self.cost.step(n, given, gained, contiguous=contiguous)
        self.pause.update(req_ids, num_tokens, found, slot_cost)
        for req_id in req_ids:  # (not paused while its prompt joins its tree)
            req = self.requests.get(req_id)
            if req is not None and req.backlog:
                self.resume_at.pop(req_id, None)

    def _add_pending(self, req: _Request, due: bool) -> bool:
        """Add the request's pending tokens to its tree: all of them, or with a prompt's backlog
        a slice at a settle that is ``due`` (none at others). Returns whether some are left."""
        longest = self.longest
        if req.backlog:
            if not due:
                return True
            cut = req.backlog
            part, req.pending = req.pending[:cut], req.pending[cut:]
            req.cursor = req.tree.add(part, req.cursor)
            if req.pending:  # (the context's longest suffix held, found again in the grown tree)
                req.draft_node = req.tree.longest_suffix(req.tokens[-longest:], longest)
                return True
            req.backlog = 0
        elif req.pending:
            req.cursor = req.tree.add(req.pending, req.cursor)
            req.pending = []
        req.draft_node = _longest_node(req.cursor, longest)
        return False

    def _catch_up(
        self, req_id: str, batch: ProposalBatch, i: int, longest: int
    ) -> tuple[_Request, int | None]:
        """The request's state, with the tokens it gained since the last call added; and how
        many it gained (None: a request not seen before)."""
        req = self.requests.get(req_id)
        seen = req is not None
        if req is None:
            req = self.requests[req_id] = _Request(
                SuffixTree(self.depth), int(batch.num_prompt_tokens[i])
            )
        have, now = len(req.tokens), int(batch.num_tokens[i])
        if now > have:
            new = batch.token_ids[batch.rows[i], have:now].tolist()
            req.tokens += new
            if seen:
                # NOTE: adding a token to the tree takes ``max_tree_depth`` dictionary steps
                # with their counts; following one, a lookup or two (``follow_longest``). The
                # draft needs only the node of the context's longest suffix that the tree holds
                # (and its links): the tokens are added in
                # ``settle``, which the runner calls once the step these drafts are for is
                # launched (at batch 1 on a GPU, while the device computes it). (Matches
                # within the new tokens themselves wait for that: a repeat that starts and
                # ends among them drafts from the next call on.)
                node, follow = req.draft_node, req.tree.follow_longest
                for t in new:
                    node = follow(node, t, longest)
                req.draft_node = node
                if not req.pending:
                    self._pending.append(req)
                req.pending += new
            else:  # (a prompt: its first part's tree built in array operations, drafted from
                # at once; the rest a slice at each settle, ``PROMPT_SLICE``)
                req.cursor = req.tree.build(new[:PROMPT_FIRST])
                if len(new) > PROMPT_FIRST:
                    req.pending = new[PROMPT_FIRST:]
                    req.backlog = max(PROMPT_SLICE, -(-len(req.pending) // PROMPT_SLICES))
                    self._pending.append(req)
                    req.draft_node = req.tree.longest_suffix(new[-longest:], longest)
                else:
                    req.draft_node = _longest_node(req.cursor, longest)
            g = self.global_tree
            if not g.empty and len(new) >= longest:  # (a prompt: its last tokens decide)
                req.global_node = g.longest_suffix(new[-longest:], longest)
                req.global_version = self.global_version
            elif not g.empty:
                node = req.global_node
                if req.global_version != self.global_version:
                    # The tree changed since (an output joined it, another left: its nodes
                    # freed, perhaps reused): the node found again from the context before
                    # these tokens.
                    before = len(req.tokens) - len(new)
                    node = g.longest_suffix(req.tokens[max(0, before - longest) : before], longest)
                    req.global_version = self.global_version
                for t in new:
                    node = g.follow_longest(node, t, longest)
                req.global_node = node
        return req, (now - have if seen else None)

    def remove(self, req_ids: Iterable[str]) -> None:
        """Forget the requests; their outputs join the global tree, a slice at each ``settle``
        (a request that comes back after preemption replaces its earlier entry when it leaves
        again)."""
        self.settle()
        req_ids = list(req_ids)
        self.pause.forget(req_ids)
        gone = []
        for req_id in req_ids:
            req = self.requests.pop(req_id, None)
            if req is not None:
                gone.append(req)
                output = req.tokens[req.num_prompt :]
                self._to_cache.append((req_id, output))
                self._queued_tokens += len(output)
        if gone and self._pending:  # (a prompt's slices left for a request gone: not added)
            self._pending = [r for r in self._pending if all(r is not g for g in gone)]
        # Waiting outputs beyond what the tree holds would push each other out: the oldest go.
        bound = self.settings.global_max_tokens
        while self._to_cache and self._queued_tokens - self._caching_left() > bound:
            self._queued_tokens -= len(self._to_cache.popleft()[1])

    def _caching_left(self) -> int:
        """Tokens of the output joining the global tree that are not in it yet."""
        if self._caching is None:
            return 0
        req_id, output, _ = self._caching
        return len(output) - len(self.cached[req_id])

    def _cache_slice(self, budget: int) -> None:
        """Add at most ``budget`` tokens of the outputs waiting to join the global tree.

        NOTE: adding an output takes ``max_tree_depth`` dictionary steps a token (128 tokens:
        3.6 ms of an H200 host's time, measured). Done at once when a request left, that
        lands in the next step's launch, which at batch 1 is the next request's prefill, with
        the device idle; a slice at each ``settle`` runs while the device computes the step
        just launched. A request's node in the global tree stays a node of its context while
        an output is added (adding frees nothing), so the tree's version moves when an output
        is complete or one is dropped: requests then find their node again."""
        while budget > 0:
            if self._caching is None:
                if not self._to_cache:
                    return
                req_id, output = self._to_cache.popleft()
                if not self._start_caching(req_id, output):
                    self._queued_tokens -= len(output)
                    continue
            req_id, output, cursor = self._caching  # type: ignore[misc]
            added = self.cached[req_id]
            part = output[len(added) : len(added) + budget]
            cursor = self.global_tree.add(part, cursor)
            added += part
            budget -= len(part)
            self._queued_tokens -= len(part)
            if len(added) < len(output):
                self._caching = (req_id, output, cursor)
            else:
                self._caching = None
                self.global_version += 1

    def _start_caching(self, req_id: str, output: list[int]) -> bool:
        """Make room for ``output`` in the global tree (its earlier entry and the oldest ones
        out); False where it does not go in."""
        bound = self.settings.global_max_tokens
        old = self.cached.pop(req_id, None)
        if old is not None:
            self._drop(old)
        if not output or len(output) > bound:
            return False
        while self.cached and self.cached_tokens + len(output) > bound:
            self._drop(self.cached.popitem(last=False)[1])
        self.cached[req_id] = []  # (the tokens added so far)
        self.cached_tokens += len(output)
        self._caching = (req_id, output, None)
        return True

    def _drop(self, tokens: list[int]) -> None:
        self.global_tree.remove(tokens)
        self.cached_tokens -= len(tokens)
        self.global_version += 1
