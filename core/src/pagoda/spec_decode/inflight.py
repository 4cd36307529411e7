"""Speculation that keeps the host ahead of the device: drafts for a request whose previous step
is still running, and a back-off for requests whose drafts keep failing.

With async scheduling the scheduler plans step N+1 while the device runs step N, before it knows
how many of step N's drafts were accepted. Each step takes one of two ways, by the number of
requests running (:func:`alternate_from`):

*Draft slots*, below :data:`ALTERNATE_FROM` requests: the scheduler plans optimistically (as
vLLM's async scheduler does): a decoding request with a step in flight is scheduled as if every
draft of that step were accepted, with up to ``k`` *draft slots* (``-1`` placeholders in
``scheduled_spec_decode_tokens``) whose KV cache slots it reserves. The model runner, once step
N's tokens are on the host, knows each request's true length, asks the proposer for drafts from
the fresh history and fills the slots (:func:`fill_draft_slots`); slots it cannot fill stay
empty, and a step where none is filled is an ordinary decode step. Its output says how many
drafts each request verified (``ModelRunnerOutput.draft_counts``); the scheduler rolls
``num_computed_tokens`` back by the reserved slots that did not become accepted tokens, as for
rejected drafts. The host then waits for the device once per step only inside the runner, just
before it builds the next step, while scheduling and output processing overlap the device as
without speculation.

*Alternating*, from :data:`ALTERNATE_FROM` requests on: a request whose step with drafts is in
flight sits out the next step (its length is not known yet) and drafts again, from the tokens
that step produced, in the one after; a request whose plain step is in flight and whose last
proposal had drafts sits out once for the same reason. No launch ever waits for the step in
flight: requests of different phases share each step, and plain rows take their last token from
the device.

The scheduler tells the runner which way a step goes (``SchedulerOutput.alternate_drafts``), and
a proposer that reads only history is asked at launch for a step's draft slots and after an
alternating step's output for the drafts its requests verify two steps later. Requests switch at
any step boundary: one whose slot step with drafts is in flight sits out the first alternating
step, and one that sat out the last alternating step verifies the drafts proposed for it in the
first slot step. :class:`DraftBackoff` keeps requests whose drafts are rejected (or never found)
from drafting every step, so that with nothing accepted most steps are plain decode steps that
need no wait at all; where steps alternate, requests whose drafts do not pay for the step they
sit out (fewer than 2 accepted) back off too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pagoda.spec_decode.verify import propose

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.step import SchedulerOutput
    from pagoda.worker.model_runner import ModelRunner
    from pagoda.worker.step_output import StepOutput

# A request drafts every step until it misses twice in a row (no draft accepted, or none
# found); then every 2nd, 4th, ... step, at most every ``2 ** _MAX_LEVEL``-th, until a draft of
# it is accepted. Below ``_MIN_BATCH`` running requests a verification step costs about what a
# decode step does, and nobody backs off (draft slots, or no async scheduling; alternating drafts
# back off at any batch size: there a miss costs the step sat out).
_MISSES_BEFORE_BACKOFF = 2
_MAX_LEVEL = 4
_MIN_BATCH = 8


#: Speculation fills draft slots while fewer requests than this run and alternates from this
#: many on. At batch 1 a step's cost is mostly the host's, so waiting for
#: the step in flight costs little while a step sat out costs a whole step (on an H200, SmolLM2
#: at batch 1 and k = 8: 2.06x with slots, 1.79x alternating with the governor); at batch 64
#: the wait exposes the device's latency every step (0.65x with slots, 0.93x alternating).
#: A power of two, so that each of the speculation governor's batch-size buckets (1, 2-3, 4-7,
#: 8-15, ...) measures drafting in one mode only.
ALTERNATE_FROM = _MIN_BATCH


def alternate_from(config: EngineConfig) -> int | None:
    """From how many running requests a step's speculation alternates instead of filling draft
    slots (a request whose step with drafts is in flight sits out the next step and drafts
    again, fresh, in the one after, so that the runner never waits for a step in flight; a
    request drafting nothing runs every step): :data:`ALTERNATE_FROM`, or None without async
    scheduling (every step is read before the next is scheduled)."""
    return ALTERNATE_FROM if config.scheduler.async_scheduling else None


class DraftBackoff:
    """Which requests may draft this step: exponential back-off after consecutive misses.

    The steps a backed-off request drafts in are multiples of its period on one step counter, so
    that requests at the same level draft in the same steps and the steps between them carry no
    drafts at all (plain decode steps, which overlap the device)."""

    def __init__(self, min_accepted: int = 1, min_batch: int = _MIN_BATCH) -> None:
        self.step = 0
        self._misses: dict[str, int] = {}
        # Accepted drafts a step needs to count as a hit.
        self.min_accepted = min_accepted
        # Running requests from which requests back off. NOTE: with alternating drafts a miss
        # costs a whole step sat out at any batch size, so there it is 1.
        self.min_batch = min_batch

    def tick(self) -> None:
        """A new schedule."""
        self.step += 1

    def allows(self, req_id: str, num_running: int, ahead: int = 0) -> bool:
        """Whether ``req_id`` may have drafts scheduled this step (``ahead``: that many steps
        later), with ``num_running`` requests running."""
        misses = self._misses.get(req_id, 0)
        if misses < _MISSES_BEFORE_BACKOFF or num_running < self.min_batch:
            return True
        level = min(misses - _MISSES_BEFORE_BACKOFF + 1, _MAX_LEVEL)
        return (self.step + ahead) % (1 << level) == 0

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A step that reserved draft slots for ``req_id``: ``num_drafts`` were filled and
        ``num_accepted`` of them accepted."""
        if num_drafts and num_accepted >= self.min_accepted:
            self._misses.pop(req_id, None)
        else:
            self._misses[req_id] = self._misses.get(req_id, 0) + 1

    def forget(self, req_id: str) -> None:
        self._misses.pop(req_id, None)


def must_read_last(
    last: StepOutput, so: SchedulerOutput, runner: ModelRunner | None = None
) -> bool:
    """Whether a launch must wait for ``last``, the step in flight: to fill draft slots from
    its tokens (unless the proposer is sure to draft nothing for them: ``runner`` given), or
    because a request of this step verified drafts there (its length is known only then).
    Plain decode rows take their last token from the device instead."""
    spec = so.scheduled_spec_decode_tokens
    slots = [r for r, ids in spec.items() if is_slots(ids)]
    if slots and (runner is None or not all(_paused(runner, last, r) for r in slots)):
        return True
    if slots:  # NOTE: paused requests' slots stay empty (none of their proposals is fresh)
        for req_id in slots:
            runner._proposals.pop(req_id, None)
    if last.drafted is None or not last.drafted.any():
        return False
    drafted = {last.req_ids[i] for i in last.sample_idx[last.drafted].tolist()}
    return any(r in drafted for r in so.num_scheduled_tokens)


def _paused(runner: ModelRunner, last: StepOutput, req_id: str) -> bool:
    """Whether the proposer will not be asked for ``req_id`` once ``last`` is read: it backs
    off (``SpeculativeProposer.resume_at``) past the most tokens the request can know then."""
    resume = getattr(runner.proposer, "resume_at", None)
    row = runner.input_batch.row_of.get(req_id)
    if not resume or req_id not in resume or row is None:
        return False
    most = int(runner.input_batch.num_tokens[row])  # a plain step's token is counted already
    if last.drafted is not None and last.drafted.any():
        drafted = {last.req_ids[i] for i in last.sample_idx[last.drafted].tolist()}
        if req_id in drafted:
            most += runner.config.speculative.num_speculative_tokens + 1
    return most < resume[req_id]


def is_slots(draft_ids: list[int]) -> bool:
    """Whether scheduled drafts are slots for the runner to fill (``-1`` placeholders)."""
    return bool(draft_ids) and draft_ids[0] < 0


def propose_for_slots(runner: ModelRunner, spec: dict[str, list[int]]) -> None:
    """Async scheduling, for a proposer that reads only token history: propose now, once the
    step in flight (the runner's last) is read, and only for the requests whose next step has
    draft slots (backed-off requests cost nothing). Fills ``runner._proposals``."""
    slots = {r: len(ids) for r, ids in spec.items() if is_slots(ids)}
    runner._proposals = {}
    step = runner._last_step
    if slots and step is not None:
        step.get()
        propose(runner, step, runner._proposals, slots)


def fill_draft_slots(
    runner: ModelRunner,
    spec: dict[str, list[int]],
    req_ids: list[str],
    counts: np.ndarray,
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """The drafts this step verifies, by request: the scheduler's own, and the draft slots filled
    with the proposer's latest drafts (made once the previous step's tokens reached the host).

    A request with slots gets ``1 + filled`` tokens: ``counts`` ([requests of the step]) is
    corrected in place. Returns ``(drafts, filled)``: the non-empty drafts to verify, and the
    count filled per request with slots (0 where the proposer had none)."""
    proposals = runner._proposals
    drafts: dict[str, list[int]] = {}
    filled: dict[str, int] = {}
    index = {r: i for i, r in enumerate(req_ids)}
    for req_id, ids in spec.items():
        if not is_slots(ids):
            drafts[req_id] = ids
            continue
        i = index[req_id]
        got = proposals.get(req_id)
        n = 0 if got is None else min(len(got), len(ids))
        counts[i] = 1 + n
        filled[req_id] = n
        if n:
            drafts[req_id] = got[:n]
    return drafts, filled
