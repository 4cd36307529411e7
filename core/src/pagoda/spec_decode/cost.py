"""What a draft token costs at this batch size, measured by a proposer from its own calls.

A proposer is called once per engine step (for the requests that draft), so the time between
two calls is one step, and the drafts it gave at the first call are what that step verified.
Regressing step seconds on draft tokens, per batch-size bucket (1, 2-3, 4-7, ...; decayed, so
that it follows the host and the workload), gives a step's cost without drafts and the cost of
each draft token. A draft whose probability of acceptance is below :meth:`DraftCost.threshold`
(the seconds it adds over the seconds the step spends per token it emits) costs more than it
brings. The speculation governor (``pagoda.scheduler.spec_governor``) still decides whether the
batch drafts at all; this lets a proposer choose how much.

Steps whose time is not what their drafts cost are left out. At one request, the first step of
each draft count: what runs for the first time at a new verification length (a kernel compiled
for it, a oneDNN primitive made for its rows on a CPU) happens there. (At more requests a step's
draft count is a sum that seldom repeats, and such costs are a smaller part of a step; the
outlier rule catches a compile.) And a step timed far above what the fit expects of its drafts
(``OUTLIER`` times): a collection, the host busy elsewhere. Charged to the drafts of that step,
such a step once made every draft token look dear (the threshold at its ceiling), drafts then
stayed one token long, and the fit, seeing no longer drafts, kept the slope for some thirty
steps. Steps that stay that slow (``SHIFT`` in a row) mean the cost moved: the fit starts again
from them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

_IDLE_S = 5.0  # a gap this long between calls is not a step
OUTLIER = 3.0  # a step this many times what the fit expects is left out
SHIFT = 4  # ... unless this many in a row are: then the fit starts again
_WINDOW = 16  # the latest steps' seconds, whose median stands for the fit until there is one
_MIN_THRESHOLD, _MAX_THRESHOLD = 0.05, 0.9
DEFAULT_THRESHOLD = 0.2  # before the cost is measured


@dataclass(slots=True)
class _Fit:
    """Decayed sums for the regression of step seconds on draft tokens (one bucket), and the
    latest steps' seconds (for leaving outliers out)."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    outliers: int = 0  # left out in a row
    counts: set[int] | None = None  # the draft counts seen (None: not kept)

    def add(self, x: int, y: float, decay: float = 0.95) -> None:
        """Count a step of ``x`` draft tokens that took ``y`` seconds, unless it is an outlier
        (see the module's note)."""
        expected = self._expected(x)
        self.recent.append(y)
        if expected is None:  # (the first steps only set the median the next are held to)
            return
        if self.counts is not None and x not in self.counts:  # a first time at this count
            self.counts.add(x)
            return
        if y > OUTLIER * expected:
            self.outliers += 1
            if self.outliers < SHIFT:
                return
            # The steps' cost moved: the fit starts again from the latest step.
            self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.outliers = 0
        self.w = decay * self.w + 1
        self.x = decay * self.x + x
        self.y = decay * self.y + y
        self.xx = decay * self.xx + x * x
        self.xy = decay * self.xy + x * y

    def _expected(self, x: int) -> float | None:
        """The seconds the fit expects of a step of ``x`` drafts; while there is no fit, the
        median of the latest steps; None before a few steps."""
        got = self.fit()
        if got is not None:
            return got[0] + got[1] * x
        if len(self.recent) < 4:
            return None
        return sorted(self.recent)[len(self.recent) // 2]

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


class DraftCost:
    """Call :meth:`step` at every ``propose``; ask :meth:`threshold`. ``clock`` returns seconds
    (injectable for tests)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.fits: dict[int, _Fit] = {}
        self._last: tuple[float, int, int] | None = None  # (time, bucket, drafts given)
        self.emitted = 1.0  # tokens a request gains per step (decayed mean)

    def step(
        self,
        num_requests: int,
        num_drafts: int,
        tokens_gained: float | None = None,
        *,
        contiguous: bool = True,
    ) -> None:
        """A call for ``num_requests`` requests that gives ``num_drafts`` draft tokens;
        ``tokens_gained``: the tokens a request gained since the last call, on average (None:
        not known). ``contiguous=False``: steps may have run since the last call without one
        (paused requests, :class:`pagoda.spec_decode.DraftPause`): the time since is not
        counted as a step."""
        now = self.clock()
        bucket = max(num_requests, 1).bit_length()
        if self._last is not None and contiguous:
            t, b, given = self._last
            if b == bucket and now - t < _IDLE_S:
                self._fit(num_requests).add(given, now - t)
        self._last = (now, bucket, int(num_drafts))
        if tokens_gained is not None:
            self.emitted += 0.05 * (tokens_gained - self.emitted)

    def threshold(self, num_requests: int) -> float:
        """The least probability of acceptance a draft token must have, at this batch size, to
        pay for its verification."""
        fit = self._fit(num_requests).fit()
        if fit is None:
            return DEFAULT_THRESHOLD
        base, per_draft = fit
        per_token = base / max(num_requests * self.emitted, 1e-9)
        return min(max(per_draft / per_token, _MIN_THRESHOLD), _MAX_THRESHOLD)

    def _fit(self, n: int) -> _Fit:
        b = max(n, 1).bit_length()
        got = self.fits.get(b)
        if got is None:
            got = self.fits[b] = _Fit(counts=set() if b == 1 else None)
        return got
