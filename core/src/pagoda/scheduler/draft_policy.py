"""How the scheduler schedules drafts: which requests draft in a step, and how a step with a step
in flight gets them (the runner's half is ``pagoda.worker.draft_slots``).

With async scheduling the scheduler plans step N+1 while the device runs step N, before it knows
how many of step N's drafts were accepted. Each step takes one of two ways, by the number of
requests running (:attr:`DraftPolicy.alternate_from`):

*Draft slots*, below :data:`ALTERNATE_FROM` requests: the scheduler plans optimistically (as
vLLM's async scheduler does): a decoding request with a step in flight is scheduled as if every
draft of that step were accepted, with up to ``k`` *draft slots* (``-1`` placeholders in
``scheduled_spec_decode_tokens``) whose KV cache slots it reserves. The runner, once step N's
tokens are on the host, fills them with drafts proposed from the fresh history; slots it cannot
fill stay empty. Its output says how many it filled (``ModelRunnerOutput.draft_counts``), and
the scheduler rolls ``num_computed_tokens`` back by the reserved slots that did not become
accepted tokens, as for rejected drafts.

*Alternating*, from :data:`ALTERNATE_FROM` requests on: a request whose step with drafts is in
flight sits out the next step (its length is not known yet) and drafts again, from the tokens
that step produced, in the one after; a request whose plain step is in flight and whose last
proposal had drafts sits out once for the same reason. No launch ever waits for the step in
flight.

The scheduler tells the runner which way a step goes (``SchedulerOutput.alternate_drafts``).
Requests switch at any step boundary: one whose slot step with drafts is in flight sits out the
first alternating step, and one that sat out the last alternating step verifies the drafts
proposed for it in the first slot step. :class:`DraftBackoff` keeps requests whose drafts are
rejected (or never found) from drafting every step, so that with nothing accepted most steps are
plain decode steps that need no wait at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.config import EngineConfig

# A request drafts every step until it misses twice in a row (no draft accepted, or none
# found); then every 2nd, 4th, ... step, at most every ``2 ** _MAX_LEVEL``-th, until a draft of
# it is accepted. Below ``_MIN_BATCH`` running requests a verification step costs about what a
# decode step does, and nobody backs off.
_MISSES_BEFORE_BACKOFF = 2
_MAX_LEVEL = 4
_MIN_BATCH = 8

#: Speculation fills draft slots while fewer requests than this run and alternates from this
#: many on. At batch 1 a step's cost is mostly the host's, so waiting for the step in flight
#: costs little while a step sat out costs a whole step (on an H200, SmolLM2 at batch 1 and
#: k = 8: 2.06x with slots, 1.79x alternating with the governor); at batch 64 the wait exposes
#: the device's latency every step (0.65x with slots, 0.93x alternating). A power of two, so
#: that each of the speculation governor's batch-size buckets (1, 2-3, 4-7, 8-15, ...) measures
#: drafting in one way only.
ALTERNATE_FROM = _MIN_BATCH


@dataclass(frozen=True, slots=True)
class DraftPolicy:
    """The speculative section as the scheduler applies it, decoded once (:func:`draft_policy`)."""

    num_spec_tokens: int  # k: drafts (or draft slots) a decoding request gets at most
    # From how many running requests steps alternate instead of filling draft slots; None:
    # never (without async scheduling every step is read before the next is scheduled).
    alternate_from: int | None
    min_accepted: int  # accepted drafts a step needs for the back-off to count it a hit
    backoff_from: int  # running requests from which requests whose drafts miss back off

    def backoff(self) -> DraftBackoff:
        return DraftBackoff(self.min_accepted, self.backoff_from)


def draft_policy(config: EngineConfig) -> DraftPolicy | None:
    """The policy ``config`` asks for; None when speculation is off."""
    if config.speculative.method is None:
        return None
    k = config.speculative.max_num_drafts
    if not config.scheduler.async_scheduling:
        return DraftPolicy(k, None, min_accepted=1, backoff_from=_MIN_BATCH)
    # NOTE: where steps alternate a request with drafts sits a step out, so a step that drafts
    # must accept 2 to pay, and back-off applies wherever steps alternate (below, with draft
    # slots, a verification costs about what a decode step does).
    return DraftPolicy(k, ALTERNATE_FROM, min_accepted=2, backoff_from=ALTERNATE_FROM)


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
        # Running requests from which requests back off.
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
