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
- *The cost of drafts at this batch size.* The time between calls is one engine step; its
  regression on the draft tokens proposed for it, per batch-size bucket (1, 2-3, 4-7, ...), gives
  a plain step's time and the time each draft token adds.

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
from dataclasses import dataclass, field

import numpy as np

_DECAY = 0.98  # per observation, for the engine-wide counts (a window of some 50 drafts)
_PRIOR = 2.0  # weight of the engine-wide rate in a request's own estimate, in trials
_MIN_THRESHOLD, _MAX_THRESHOLD = 0.05, 0.9
_DEFAULT_THRESHOLD = 0.2  # before the cost is measured


@dataclass
class _Request:
    drafts: list[int] = field(default_factory=list)  # the last ones given
    at: int = 0  # the request's tokens when they were given
    match: int = 0  # the length of the match they came from
    hits: np.ndarray | None = None  # [k] float
    trials: np.ndarray | None = None


@dataclass
class _Cost:
    """Decayed sums for the regression of step seconds on draft tokens (one bucket)."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float, decay: float = 0.95) -> None:
        self.w = decay * self.w + 1
        self.x = decay * self.x + x
        self.y = decay * self.y + y
        self.xx = decay * self.xx + x * x
        self.xy = decay * self.xy + x * y

    def fit(self) -> tuple[float, float] | None:
        """(seconds of a step without drafts, seconds per draft token), or None while the
        drafts' counts have not varied enough to tell."""
        if self.w < 4:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < 0.25:
            return None
        slope = (self.xy / self.w - mx * my) / var
        return max(my - slope * mx, 1e-6), max(slope, 0.0)


class DraftLengths:
    """Per request draft lengths from measured acceptance and cost (see the module's note)."""

    def __init__(self, k: int, max_match: int, clock=time.perf_counter) -> None:
        self.k = k
        self.max_match = max_match
        self.clock = clock
        self.requests: dict[str, _Request] = {}
        # Engine-wide: conditional hits and trials per position, and of the first position
        # per match length (index = length). Start at a prior of 1 hit in 2 trials.
        self.hits = np.ones(k)
        self.trials = np.full(k, 2.0)
        self.first_hits = np.ones(max_match + 1)
        self.first_trials = np.full(max_match + 1, 2.0)
        self.costs: dict[int, _Cost] = {}
        self._last: tuple[float, int, int] | None = None  # (time, batch bucket, drafts given)
        self.emitted_per_step = 1.0  # tokens a request emits per step (decayed mean)

    def observe(self, req_ids: list[str], history_of, num_tokens: np.ndarray) -> None:
        """Score the drafts last given to ``req_ids`` against what followed them;
        ``history_of(i)`` is request ``i``'s tokens."""
        decay_n = 0
        for i, req_id in enumerate(req_ids):
            req = self.requests.get(req_id)
            if req is None or not req.drafts:
                continue
            came = int(num_tokens[i]) - req.at
            if came <= 0:
                continue
            seen = history_of(i)[req.at : req.at + min(came, len(req.drafts))].tolist()
            if req.hits is None:
                req.hits, req.trials = np.zeros(self.k), np.zeros(self.k)
            for j, tok in enumerate(seen):
                hit = tok == req.drafts[j]
                req.trials[j] += 1
                self.trials[j] += 1
                req.hits[j] += hit
                self.hits[j] += hit
                if j == 0:
                    self.first_trials[req.match] += 1
                    self.first_hits[req.match] += hit
                if not hit:
                    break
            self.emitted_per_step += 0.05 * (min(came, len(req.drafts) + 1) - self.emitted_per_step)
            req.drafts = []
            decay_n += 1
        if decay_n:
            d = _DECAY**decay_n
            for a in (self.hits, self.trials, self.first_hits, self.first_trials):
                a *= d
            self.hits += (1 - d) * 1.0
            self.trials += (1 - d) * 2.0
            self.first_hits += (1 - d) * 1.0
            self.first_trials += (1 - d) * 2.0

    def threshold(self, n: int) -> float:
        """The least acceptance probability a draft token must have at batch size ``n``."""
        fit = self._cost(n).fit()
        if fit is None:
            return _DEFAULT_THRESHOLD
        base, per_draft = fit
        per_token = base / max(n * self.emitted_per_step, 1e-9)
        return float(np.clip(per_draft / per_token, _MIN_THRESHOLD, _MAX_THRESHOLD))

    def lengths(
        self, req_ids: list[str], match: np.ndarray, caps: np.ndarray, n_batch: int
    ) -> np.ndarray:
        """[n] draft lengths for matches of ``match`` tokens (0: none found), at most
        ``caps``."""
        tau = self.threshold(n_batch)
        global_rate = self.hits / self.trials
        first_rate = self.first_hits / self.first_trials
        out = np.zeros(len(req_ids), dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            m = int(match[i])
            if m <= 0:
                continue
            req = self.requests.get(req_id)
            rate = global_rate.copy()
            rate[0] = first_rate[min(m, self.max_match)]
            if req is not None and req.hits is not None:
                rate = (req.hits + _PRIOR * rate) / (req.trials + _PRIOR)
            p = np.cumprod(rate[: int(caps[i])])
            out[i] = int(np.count_nonzero(p >= tau))  # p decreases: a prefix
        return out

    def gave(
        self, req_ids: list[str], drafts: np.ndarray, lengths: np.ndarray, match: np.ndarray,
        num_tokens: np.ndarray,
    ) -> None:
        """Record the drafts given (to score at the next call) and time the step before."""
        now = self.clock()
        for i, req_id in enumerate(req_ids):
            req = self.requests.get(req_id)
            if req is None:
                req = self.requests[req_id] = _Request()
            d = int(lengths[i])
            req.drafts = drafts[i, :d].tolist()
            req.at, req.match = int(num_tokens[i]), min(int(match[i]), self.max_match)
        bucket = max(len(req_ids), 1).bit_length()
        if self._last is not None:
            t, b, given = self._last
            if b == bucket and now - t < 5.0:  # (an idle engine is not a step)
                self._cost(len(req_ids)).add(float(given), now - t)
        self._last = (now, bucket, int(lengths.sum()))

    def _cost(self, n: int) -> _Cost:
        b = max(n, 1).bit_length()
        got = self.costs.get(b)
        if got is None:
            got = self.costs[b] = _Cost()
        return got

    def remove(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
