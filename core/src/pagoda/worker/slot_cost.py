"""What a step with draft slots costs beyond a step without, as the runner measures it
(``ProposalBatch.slot_cost``; ``pagoda.worker.draft_slots`` says what such a step is)."""

from __future__ import annotations

import time
from collections.abc import Callable

_SLOT_SAMPLES = 8  # steps of each kind before the cost is given
_SLOT_WEIGHT = 0.05  # of the newest step in each kind's moving mean
_SLOT_OUTLIER = 3.0  # a step this many times its kind's mean is left out (a gap, a collection)
_SLOT_GAP_S = 0.5  # ... as is any longer one while the mean forms


class SlotCost:
    """What a step with draft slots costs beyond a step without, measured by the runner: the
    time from one launch to the next, by whether the first launch waited for the step in flight
    (``must_read_last``) and by batch-size bucket (1, 2-3, 4-7, ...), for steps of one to
    ``k + 1`` tokens a request (decodes and verifications; a step with a prompt is left out, and
    a launch far from the last, a gap between requests, too). Given (``ProposalBatch.slot_cost``)
    once each kind has ``_SLOT_SAMPLES`` steps in its bucket, in steps without slots: the mean
    with slots over the mean without, less one. At batch 1 on a GPU a plain step is launched
    while the last runs and a step with slots waits for it; on an H200 (SmolLM2, the copy
    prompts) 3.5 ms against 1.7. ``clock`` returns seconds (injectable for tests)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._last: tuple[float, int, bool] | None = None  # (time, bucket, waited)
        self._means: dict[tuple[int, bool], tuple[float, int]] = {}  # -> (seconds, steps)

    def launched(self, num_reqs: int, waited: bool, counted: bool = True) -> None:
        """A launch of ``num_reqs`` requests, which waited for the step in flight or not;
        ``counted=False``: a step not to measure (a prompt in it), whose time the next launch
        would otherwise give."""
        now = self.clock()
        last = self._last
        if last is not None:
            t, bucket, was = last
            self._add(bucket, was, now - t)
        self._last = (now, num_reqs.bit_length(), waited) if counted else None

    def _add(self, bucket: int, waited: bool, seconds: float) -> None:
        mean, n = self._means.get((bucket, waited), (0.0, 0))
        if seconds > (_SLOT_OUTLIER * mean if n >= _SLOT_SAMPLES else _SLOT_GAP_S):
            return
        mean = seconds if n == 0 else mean + max(_SLOT_WEIGHT, 1 / (n + 1)) * (seconds - mean)
        self._means[(bucket, waited)] = (mean, n + 1)

    def cost(self, num_reqs: int) -> float | None:
        bucket = num_reqs.bit_length()
        slots, n_slots = self._means.get((bucket, True), (0.0, 0))
        plain, n_plain = self._means.get((bucket, False), (0.0, 0))
        if min(n_slots, n_plain) < _SLOT_SAMPLES or plain <= 0:
            return None
        return max(slots / plain - 1.0, 0.0)
