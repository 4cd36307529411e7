"""What a step with draft slots costs beyond a step without, as the runner measures it
(``ProposalBatch.slot_cost``; ``pagoda.worker.draft_slots`` says what such a step is)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

_SLOT_SAMPLES = 8  # steps of each kind before the cost is given
_SLOT_WEIGHT = 0.05  # of the newest step in each kind's moving mean
_SLOT_OUTLIER = 3.0  # a step this many times its kind's mean is left out (a gap, a collection)
_SLOT_GAP_S = 0.5  # ... as is any longer one while the mean forms


class SlotCost:
    """What a step with draft slots costs beyond a step without, measured by the runner: the
    time from one launch to the next, by batch-size bucket (1, 2-3, 4-7, ...), for decode steps
    that waited for the step in flight to fill their slots and found no draft to fill them with,
    against decode steps that did not wait. What is left between the two is the wait itself: on
    a GPU at batch 1 a plain step launches while the last runs, so a step with slots gave up that
    overlap; on a CPU, whose steps do not overlap, next to nothing. What drafts cost to verify is
    not in it (``pagoda.spec_decode.DraftCost`` prices each draft token). Steps with drafts, with
    a prompt, or far from the last launch (a gap between requests) are not timed. The proposer's
    bookkeeping between two launches (``SpeculativeProposer.settle``: the suffix proposer adds
    the tokens its last call saw to its trees there) is not counted (:meth:`exclude`): it
    follows the steps where the proposer was asked, but a pause defers it and does not save it,
    and counted it made slots look dear to the proposers that keep such books (on an H200 at
    batch 1, the copy set, a cost of 0.49 for suffix against 0.27 for n-gram). Given
    (``ProposalBatch.slot_cost``) once each kind has ``_SLOT_SAMPLES`` steps in its bucket, in
    steps without slots: the mean with slots over the mean without, less one. ``clock`` returns
    seconds (injectable for tests)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._last: tuple[float, int, bool] | None = None  # (time, bucket, waited)
        self._means: dict[tuple[int, bool], tuple[float, int]] = {}  # -> (seconds, steps)
        self._excluded = 0.0  # seconds since the last launch not to count (``exclude``)
        self._first: dict[tuple[int, bool], list[float]] = {}  # the first steps' seconds

    def launched(self, num_reqs: int, waited: bool | None, at: float | None = None) -> None:
        """A launch of ``num_reqs`` requests at ``at`` (the clock's now by default): a decode
        step that waited for the step in flight (``True``) or did not (``False``), or a step not
        to time (``None``: drafts or a prompt in it), whose time the next launch would
        otherwise give."""
        now = self.clock() if at is None else at
        last, excluded = self._last, self._excluded
        self._excluded = 0.0
        if last is not None:
            t, bucket, was = last
            self._add(bucket, was, now - t - excluded)
        self._last = None if waited is None else (now, num_reqs.bit_length(), waited)

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` spent since the last launch out of its step's time (the
        proposer's bookkeeping, see the class's note)."""
        self._excluded += seconds

    def _add(self, bucket: int, waited: bool, seconds: float) -> None:
        key = (bucket, waited)
        mean, n = self._means.get(key, (0.0, 0))
        if n < _SLOT_SAMPLES:
            # NOTE: the mean starts from the median of the first steps: a first-time cost
            # among them (a kernel compiled, a module loaded at its first launch: tens of ms)
            # set it several times too high, the later steps' 5% each brought it down over
            # some forty slot steps, and requests paused (up to 32 steps) for a cost that
            # was not there.
            if seconds > _SLOT_GAP_S:
                return
            first = self._first.setdefault(key, [])
            first.append(seconds)
            self._means[key] = (statistics.median(first), n + 1)
            if n + 1 == _SLOT_SAMPLES:
                del self._first[key]
            return
        if seconds > _SLOT_OUTLIER * mean:
            return
        mean += max(_SLOT_WEIGHT, 1 / (n + 1)) * (seconds - mean)
        self._means[key] = (mean, n + 1)

    def cost(self, num_reqs: int) -> float | None:
        bucket = num_reqs.bit_length()
        slots, n_slots = self._means.get((bucket, True), (0.0, 0))
        plain, n_plain = self._means.get((bucket, False), (0.0, 0))
        if min(n_slots, n_plain) < _SLOT_SAMPLES or plain <= 0:
            return None
        return max(slots / plain - 1.0, 0.0)

    def summary(self, num_reqs: int) -> dict[str, float | int | None]:
        """What was measured at ``num_reqs``' bucket (for reports): each kind's mean
        launch-to-launch milliseconds and steps, and the cost given from them."""
        bucket = num_reqs.bit_length()
        slots, n_slots = self._means.get((bucket, True), (0.0, 0))
        plain, n_plain = self._means.get((bucket, False), (0.0, 0))
        return {
            "waited_ms": round(slots * 1e3, 4) if n_slots else None,
            "waited_steps": n_slots,
            "plain_ms": round(plain * 1e3, 4) if n_plain else None,
            "plain_steps": n_plain,
            "cost": self.cost(num_reqs),
        }
