"""The runner's half of speculation with a step in flight (the scheduler's is
``pagoda.scheduler.draft_policy``): whether a launch must wait for the step in flight, and the
drafts that fill a step's draft slots.

Below ``ALTERNATE_FROM`` running requests a decoding request with a step in flight is scheduled
with ``k`` draft slots (``-1`` placeholders). The runner, once that step's tokens are on the host,
knows each request's true length, asks the proposer for drafts from the fresh history and fills
the slots (:func:`fill_draft_slots`); slots it cannot fill stay empty, and a step where none is
filled is an ordinary decode step. The host then waits for the device once per step only here,
just before it builds the next step, while scheduling and output processing overlap the device as
without speculation. A proposer that reads only history is asked at launch, for the requests with
slots only (:func:`propose_for_slots`); one that reads hidden states, after each step's output.
Where steps alternate there are no slots: a request whose step with drafts is in flight sits the
next step out, so no launch waits.
"""

from __future__ import annotations

import numpy as np

from pagoda.step import SchedulerOutput, is_draft_slots
from pagoda.worker.spec_propose import propose
from pagoda.worker.speculation import Speculation
from pagoda.worker.step_output import StepOutput


def must_read_last(spec: Speculation | None, last: StepOutput, so: SchedulerOutput) -> bool:
    """Whether a launch must wait for ``last``, the step in flight: to fill draft slots from
    its tokens (unless the proposer is sure to draft nothing for them), or because a request of
    this step verified drafts there (its length is known only then). Plain decode rows take
    their last token from the device instead."""
    scheduled = so.scheduled_spec_decode_tokens
    slots = [r for r, ids in scheduled.items() if is_draft_slots(ids)]
    if slots and (spec is None or not all(paused(spec, last, r) for r in slots)):
        return True
    if slots:  # NOTE: paused requests' slots stay empty (none of their proposals is fresh)
        for req_id in slots:
            spec.proposals.pop(req_id, None)
    if last.drafted is None or not last.drafted.any():
        return False
    drafted = {last.req_ids[i] for i in last.sample_idx[last.drafted].tolist()}
    return any(r in drafted for r in so.num_scheduled_tokens)


def paused(spec: Speculation, last: StepOutput, req_id: str) -> bool:
    """Whether the proposer will not be asked for ``req_id`` once ``last`` is read: it backs
    off (``SpeculativeProposer.resume_at``) past the most tokens the request can know then."""
    resume = getattr(spec.proposer, "resume_at", None)
    ib = spec.input_batch
    row = ib.row_of.get(req_id)
    if not resume or req_id not in resume or row is None:
        return False
    most = int(ib.num_tokens[row])  # a plain step's token is counted already
    if last.drafted is not None and last.drafted.any():
        drafted = {last.req_ids[i] for i in last.sample_idx[last.drafted].tolist()}
        if req_id in drafted:
            most += spec.num_spec_tokens + 1
    return most < resume[req_id]


def propose_for_slots(spec: Speculation, scheduled: dict[str, list[int]]) -> None:
    """Async scheduling, for a proposer that reads only token history: propose now, once the
    step in flight (the last launched) is read, and only for the requests whose next step has
    draft slots (backed-off requests cost nothing). Fills ``spec.proposals``."""
    slots = {r: len(ids) for r, ids in scheduled.items() if is_draft_slots(ids)}
    spec.proposals = {}
    step = spec.in_flight.last
    if not slots or step is None:
        return
    if not step.done and all(paused(spec, step, r) for r in slots):
        # Paused requests' slots stay empty (``must_read_last``): reading the step in flight
        # for them alone would make the launch wait, every step at batch 1. (Where it is read
        # for another request, ``propose`` leaves them out itself.)
        return
    step.get()
    propose(spec, step, spec.proposals, slots)


def fill_draft_slots(
    spec: Speculation,
    scheduled: dict[str, list[int]],
    req_ids: list[str],
    counts: np.ndarray,
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """The drafts this step verifies, by request: the scheduler's own, and the draft slots filled
    with the proposer's latest drafts (made once the previous step's tokens reached the host).

    A request with slots gets ``1 + filled`` tokens: ``counts`` ([requests of the step]) is
    corrected in place. Returns ``(drafts, filled)``: the non-empty drafts to verify, and the
    count filled per request with slots (0 where the proposer had none)."""
    proposals = spec.proposals
    drafts: dict[str, list[int]] = {}
    filled: dict[str, int] = {}
    index = {r: i for i, r in enumerate(req_ids)}
    for req_id, ids in scheduled.items():
        if not is_draft_slots(ids):
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
