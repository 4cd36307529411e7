"""Each request's draft length and the shortest match worth drafting from, chosen from what the
proposer measures (when ``num_speculative_tokens`` and the lookup keys are not given).

What it measures:

- *Acceptance per position.* At each call the drafts a request was given last time are compared
  with the tokens that followed them: position ``j`` was a trial if ``j`` tokens had come, and a
  hit if it equals the token that came and every draft before it was a hit. Under greedy decoding
  that is what verification accepts, whether or not the drafts were scheduled; under sampling it
  estimates it. Hits and trials are counted per request and position, and for the whole engine
  per position and per length of the match the drafts came from (decayed, so that they follow
  the workload).
- *The cost of drafts at this batch size* (:class:`pagoda.spec_decode.DraftCost`): the time
  between calls is one engine step; its regression on the draft tokens given for it, per
  batch-size bucket (1, 2-3, 4-7, ...), gives a plain step's time and the time each draft token
  adds.

What it decides: a draft at position ``j`` is proposed while the probability that it is
accepted (the product of the conditional rates up to ``j``, the first of them by the match's
length) is at least the draft's relative cost: the seconds a draft token adds over the seconds
the step spends per emitted token. A match whose first draft would be accepted less often than
that is not drafted from at all: the lookup window's low end adapts. Whether drafting pays for
the whole batch is the speculation governor's to measure (``speculative.adaptive``); this picks
lengths within it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from pagoda.spec_decode import DraftCost

_DECAY = 0.98  # per observation, for the engine-wide counts (a window of some 50 drafts)
_PRIOR = 2.0  # weight of the engine-wide rate in a request's own estimate, in trials
# Batches of at most this many requests are scored and given lengths a request at a time: the
# vectorised passes are some 60 numpy calls, which at batch 1 took 94 and 45 us a step on a CPU
# (a verifying step's host work there is about 1.6 ms). The same arithmetic in the same order,
# so the same counts and lengths.
_ROW_MAX_BATCH = 4


class DraftLengths:
    """Per request draft lengths from measured acceptance and cost (see the module's note).

    Per-request state lives in arrays indexed by the request's row of the runner's token array
    (``ProposalBatch.rows``), so that every call is a few numpy operations over the batch."""

    def __init__(
        self,
        k: int,
        max_match: int,
        max_num_reqs: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.k = k
        self.max_match = max_match
        self.cost = DraftCost(clock)
        self.owner: list[str | None] = [None] * max_num_reqs  # the request each row's state is of
        self.row_of: dict[str, int] = {}
        self.given = np.full((max_num_reqs, k), -1, dtype=np.int64)  # the last drafts given
        self.at = np.zeros(max_num_reqs, dtype=np.int64)  # the row's tokens when given
        self.match = np.zeros(max_num_reqs, dtype=np.int64)  # the match they came from
        self.hits = np.zeros((max_num_reqs, k))
        self.trials = np.zeros((max_num_reqs, k))
        # Engine-wide: conditional hits and trials per position, and of the first position
        # per match length (index = length), from a prior of 1 hit in 2 trials.
        # (views of one array, which decays toward its prior in two operations a call)
        m = max_match + 1
        self._wide = np.concatenate([np.ones(k), np.full(k, 2.0), np.ones(m), np.full(m, 2.0)])
        self._prior = self._wide.copy()
        self.g_hits, self.g_trials = self._wide[:k], self._wide[k : 2 * k]
        self.first_hits, self.first_trials = self._wide[2 * k : 2 * k + m], self._wide[2 * k + m :]
        self._gained: float | None = None  # tokens a request gained since the last call

    def own(self, req_ids: list[str], rows: np.ndarray) -> np.ndarray:
        """[n] bool: rows whose state is of the request now there (others are reset)."""
        owner = self.owner
        mine = np.fromiter(
            (owner[r] == q for r, q in zip(rows.tolist(), req_ids)), bool, len(req_ids)
        )
        if not mine.all():
            fresh = rows[~mine]
            self.given[fresh] = -1
            self.hits[fresh] = 0.0
            self.trials[fresh] = 0.0
            for r, q in zip(fresh.tolist(), (q for q, m in zip(req_ids, mine) if not m)):
                old = owner[r]
                if old is not None and self.row_of.get(old) == r:
                    del self.row_of[old]
                owner[r] = q
                self.row_of[q] = r
        return mine

    def observe(self, rows: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray) -> None:
        """Score the drafts last given to the rows against the tokens that followed them."""
        if len(rows) <= _ROW_MAX_BATCH:
            self._observe_rows(rows.tolist(), token_ids, num_tokens.tolist())
            return
        given = self.given[rows]
        at = self.at[rows]
        cols = np.arange(self.k)
        came = num_tokens - at
        known = (given >= 0) & (cols[None, :] < came[:, None])
        if not known.any():
            return
        pos = np.minimum(at[:, None] + cols[None, :], token_ids.shape[1] - 1)
        agree = (token_ids[rows[:, None], pos] == given) & known
        prefix = np.cumprod(agree, axis=1).astype(bool)  # every draft up to j was a hit
        tried = known.copy()
        tried[:, 1:] &= prefix[:, :-1]
        hit = prefix & tried
        self.trials[rows] += tried
        self.hits[rows] += hit
        scored = tried[:, 0]
        self._decay(int(scored.sum()))
        self.g_trials += tried.sum(axis=0)
        self.g_hits += hit.sum(axis=0)
        m = self.match[rows]
        np.add.at(self.first_trials, m[scored], 1.0)
        np.add.at(self.first_hits, m[scored], hit[scored, 0])
        out = np.minimum(came[scored], hit[scored].sum(axis=1) + 1)
        self._gained = float(out.mean()) if len(out) else None
        self.given[rows] = -1

    def _decay(self, scored: int) -> None:
        """Decay the engine-wide counts toward their prior, once for each of ``scored`` rows."""
        decay = _DECAY**scored
        wide = self._wide
        wide *= decay
        wide += (1 - decay) * self._prior

    def _observe_rows(self, rows: list[int], token_ids: np.ndarray, num_tokens: list[int]) -> None:
        """:meth:`observe` a row at a time. A row's drafts are a prefix of its ``given`` (-1
        after), so its scores are two counts: ``tried`` positions from the first, of which the
        first ``hit`` were hits."""
        scores = []  # (row, tried, hit, came)
        last = token_ids.shape[1] - 1
        for r, num in zip(rows, num_tokens):
            at = int(self.at[r])
            came = num - at
            if came <= 0:
                continue
            given = self.given[r, : min(came, self.k)].tolist()
            tried = next((j for j, g in enumerate(given) if g < 0), len(given))
            if tried == 0:
                continue
            # (positions past the array's end compare with its last token, as observe does)
            tokens = token_ids[r, at : at + tried].tolist()
            tokens += [int(token_ids[r, last])] * (tried - len(tokens))
            hit = next((j for j in range(tried) if tokens[j] != given[j]), tried)
            scores.append((r, min(hit + 1, tried), hit, came))
        if not scores:
            return
        self._decay(len(scores))
        # (the engine-wide counts summed over the rows first, then added once, as observe does;
        # one row's are its own, added where they are not 0)
        if len(scores) == 1:
            r, tried, hit, _ = scores[0]
            self.trials[r, :tried] += 1.0
            self.hits[r, :hit] += 1.0
            self.g_trials[:tried] += 1.0
            self.g_hits[:hit] += 1.0
        else:
            tried_at, hit_at = np.zeros(self.k, np.int64), np.zeros(self.k, np.int64)
            for r, tried, hit, _ in scores:
                self.trials[r, :tried] += 1.0
                self.hits[r, :hit] += 1.0
                tried_at[:tried] += 1
                hit_at[:hit] += 1
            self.g_trials += tried_at
            self.g_hits += hit_at
        for r, _, hit, _ in scores:
            m = self.match[r]
            self.first_trials[m] += 1.0
            self.first_hits[m] += float(hit > 0)
        self._gained = sum(min(came, hit + 1) for _, _, hit, came in scores) / len(scores)
        for r in rows:
            self.given[r] = -1

    def lengths(self, rows: np.ndarray, match: np.ndarray, caps: np.ndarray) -> np.ndarray:
        """[n] draft lengths for the rows' matches of ``match`` tokens (0: none found), at
        most ``caps``."""
        tau = self.cost.threshold(len(rows))
        if len(rows) <= _ROW_MAX_BATCH:
            return np.array(
                [
                    self._length(r, m, c, tau)
                    for r, m, c in zip(rows.tolist(), match.tolist(), caps.tolist())
                ],
                dtype=np.int64,
            )
        rate = np.repeat((self.g_hits / self.g_trials)[None, :], len(rows), axis=0)
        rate[:, 0] = (self.first_hits / self.first_trials)[np.minimum(match, self.max_match)]
        rate = (self.hits[rows] + _PRIOR * rate) / (self.trials[rows] + _PRIOR)
        p = np.cumprod(rate, axis=1)
        ok = (p >= tau) & (np.arange(self.k)[None, :] < caps[:, None])
        out = np.cumprod(ok, axis=1).sum(axis=1)
        out[match <= 0] = 0
        return out.astype(np.int64)

    def _length(self, row: int, match: int, cap: int, tau: float) -> int:
        """:meth:`lengths` of one row."""
        if match <= 0:
            return 0
        hits, trials = self.hits[row].tolist(), self.trials[row].tolist()
        m = min(match, self.max_match)
        p = 1.0
        for j in range(min(cap, self.k)):
            if j == 0:
                rate = float(self.first_hits[m] / self.first_trials[m])
            else:
                rate = float(self.g_hits[j] / self.g_trials[j])
            p *= (hits[j] + _PRIOR * rate) / (trials[j] + _PRIOR)
            if p < tau:
                return j
        return min(cap, self.k)

    def gave(
        self,
        rows: np.ndarray,
        drafts: np.ndarray,
        match: np.ndarray,
        num_tokens: np.ndarray,
        contiguous: bool = True,
    ) -> None:
        """Record the drafts given (to score at the next call) and time the step before (not
        when steps may have run without a call since the last, ``contiguous=False``)."""
        self.given[rows] = drafts
        self.at[rows] = num_tokens
        self.match[rows] = np.minimum(match, self.max_match)
        self.cost.step(len(rows), int((drafts >= 0).sum()), self._gained, contiguous=contiguous)
        self._gained = None

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.owner[row] = None
            self.given[row] = -1
