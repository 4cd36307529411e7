"""Suffix decoding: drafts from the request's own tokens and from a global tree over the recent
outputs of other requests (after SuffixDecoding, Oliaro et al., 2024).

A request's own tokens (prompt and output) are searched where its own suffix tree would be
kept (:mod:`pagoda_spec_suffix.history`: the counts such a tree of depth ``max_tree_depth``
gives, read from the token row at each call); the global tree
(:class:`~pagoda_spec_suffix.tree.SuffixTree`) holds the outputs of requests that left, each
request keeping its cursor there (the node of its context's longest suffix). A request's output
goes into the global tree once the request leaves (``remove``), a slice at each ``settle`` after
a call (:meth:`SuffixProposer._cache_slice`); the global tree holds at most
``global_max_tokens`` output tokens, the oldest request's dropped first. Each call drafts from
whichever source expects more accepted tokens, following the most frequent continuation of the
longest suffix matched while its estimated probability holds (at least ``min_token_prob``, and
at least what a draft token costs at this batch size, measured:
:class:`pagoda.spec_decode.DraftCost`) and for at most ``max_spec_factor`` times the match's
length: the draft length adapts to how often, and how consistently, the context was seen
before. With ``num_speculative_tokens`` unset drafts are at most 8 tokens long. A request that
keeps getting no draft pauses between probes (``pagoda.spec_decode.pause``: its steps then
launch without waiting for the step in flight).

The work per call is a search of each request's history (some tens of microseconds for a few
thousand tokens) and a lookup or two a new token in the global tree; between calls, only the
outputs joining the global tree (``benchmarks/suffix_proposer.py``).

NOTE: the request's own tokens were a tree of their own until `history` replaced it: its upkeep
(``max_tree_depth`` dictionary steps a token, a prompt's in slices) was 0.45 ms of the host's
time a step with drafts on an H200 at batch 1, on the host's critical path, and the searches
read the same counts.
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
from pagoda_spec_suffix.history import history_draft
from pagoda_spec_suffix.settings import SuffixSettings
from pagoda_spec_suffix.tree import SuffixTree

# Output tokens of requests that left that a ``settle`` adds to the global tree: at least
# CACHE_SLICE, and 1 / CACHE_SHARE of those waiting (so that the wait stays bounded when outputs
# come faster). On an H200's host an output's 128 tokens took 3.6 ms at once (some 28 us a
# token). NOTE: a slice runs after the launch, while the device computes the step, in the
# host's slack before it reads that step: with drafts written late (``LateDrafts``) a batch-1
# copy step waited some 0.4 ms there on the H200, and a slice of 24 - 32 tokens (0.7 - 0.9 ms)
# overran it into the device's wait; 8 (0.2 ms) fit. The copy set, alternated on one H200: 8
# tokens 1.973, 1.941, 1.884 against 1.830, 1.834, 1.964 (``benchmarks/README.md``).
CACHE_SLICE = 8
CACHE_SHARE = 16
# The newest slot step's weight in a request's mean accepted drafts (the shared default: 0.5),
# whose fall below the slot cost pauses the request (``pagoda.spec_decode.pause``).
# NOTE: a copy's rejected drafts come in runs, at each edit, and the copy resumes after it; at
# 0.5 four such steps paused a request that had been accepting three drafts a step, and the
# pauses grew while its probes landed in the edit. On a CPU, at the slot costs measured on an
# H200 (0.21 suffix, 0.3 on the open set), 0.2 took fewer steps with slots' cost counted
# (benchmarks/README.md, "A slower mean for suffix's pauses").
YIELD_WEIGHT = 0.2


@dataclass
class _Request:
    num_prompt: int
    tokens: list[int] = field(default_factory=list)  # known so far, a copy
    global_node: int = 0  # the node of the context's longest suffix in the global tree
    global_version: int = -1  # the global tree's version that ``global_node`` is of


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
        self.pause = DraftPause(self.resume_at, yield_weight=YIELD_WEIGHT)
        self._given: tuple | None = None  # the last call's, until ``settle`` records it
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
        rows, nums = batch.rows.tolist(), batch.num_tokens.tolist()
        caps = np.minimum(batch.max_num_drafts, k).tolist()
        for i, req_id in enumerate(batch.req_ids):
            row, num = batch.token_ids[rows[i]], nums[i]
            req, new = self._catch_up(req_id, batch, i, row, num, longest)
            if new is not None:
                gained, known = gained + new, known + 1
            cap = int(caps[i])
            best, score, _ = history_draft(
                row, num, longest, cap, floor, s.max_spec_factor, self.depth
            )
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
        """Add a slice of the outputs waiting to join the global tree (at the first ``settle``
        after a call, at least ``CACHE_SLICE`` tokens and ``1 / CACHE_SHARE`` of those waiting,
        so that the wait stays bounded when outputs come faster); record the last call's step
        time and its requests' pauses."""
        if self._slice_due:
            # (the first settle since a call: the runner's, after the launch of that call's
            # drafts; later ones, at the next launch's start, are on the host's critical path)
            self._slice_due = False
            if self._to_cache or self._caching is not None:
                self._cache_slice(max(CACHE_SLICE, self._queued_tokens // CACHE_SHARE))
        if self._given is None:
            return
        n, given, gained, contiguous, req_ids, num_tokens, found, slot_cost = self._given
        self._given = None
        self.cost.step(n, given, gained, contiguous=contiguous)
        self.pause.update(req_ids, num_tokens, found, slot_cost)

    def _catch_up(
        self, req_id: str, batch: ProposalBatch, i: int, row: np.ndarray, num: int, longest: int
    ) -> tuple[_Request, int | None]:
        """The request's state, with the tokens it gained since the last call (``row[:num]``
        known now) followed in the global tree; and how many it gained (None: a request not
        seen before)."""
        req = self.requests.get(req_id)
        seen = req is not None
        if req is None:
            req = self.requests[req_id] = _Request(int(batch.num_prompt_tokens[i]))
        have = len(req.tokens)
        if num > have:
            new = row[have:num].tolist()
            req.tokens += new
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
        return req, (num - have if seen else None)

    def remove(self, req_ids: Iterable[str]) -> None:
        """Forget the requests; their outputs join the global tree, a slice at each ``settle``
        (a request that comes back after preemption replaces its earlier entry when it leaves
        again)."""
        self.settle()
        req_ids = list(req_ids)
        self.pause.forget(req_ids)
        for req_id in req_ids:
            req = self.requests.pop(req_id, None)
            if req is not None:
                output = req.tokens[req.num_prompt :]
                self._to_cache.append((req_id, output))
                self._queued_tokens += len(output)
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
