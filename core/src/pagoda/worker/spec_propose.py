"""Asking the proposer for drafts: for the requests that sampled in a step, once its tokens are
on the host (``SpeculativeProposer.propose``)."""

from __future__ import annotations

import numpy as np

from pagoda.spec_decode.proposer import ProposalBatch
from pagoda.step import ModelRunnerOutput
from pagoda.worker.speculation import Speculation
from pagoda.worker.step_output import StepOutput


def propose_after(
    spec: Speculation, step: StepOutput, output: ModelRunnerOutput, draft: bool = True
) -> None:
    """Ask the proposer for drafts for the requests that sampled in ``step`` (still running
    in the same row), now that their tokens are on the host; they go out in ``output``.
    ``draft=False`` (drafting off): only keep their hidden states for a later draft."""
    spec.proposals = output.draft_token_ids  # NOTE: only the latest step's drafts are fresh
    propose(spec, step, output.draft_token_ids, draft=draft)


def propose(
    spec: Speculation,
    step: StepOutput,
    into: dict[str, list[int]],
    slots: dict[str, int] | None = None,
    draft: bool = True,
) -> None:
    """Drafts for the requests that sampled in ``step`` (read already), by request id into
    ``into``; with ``slots`` (request id -> draft slots of the next step) only for those, at
    most that many each. ``draft=False``: the proposer is not asked (drafting is off; its
    drafts would be scheduled nowhere), and the hidden states it reads wait in the feed, the
    most recent ``HiddenFeed.max_hold`` positions of each request."""
    proposer = spec.proposer
    proposer.settle()  # (its pauses, read below, as of its last call)
    ib = spec.input_batch
    if step.num_emitted is None or not len(step.sample_idx):
        return
    feed = spec.hidden_feed if step.hidden_feed is not None else None
    if not draft:
        if feed is not None:
            feed.defer(step)
        return
    # NOTE: plain Python over the step's sampling requests: this runs after every step, and
    # at a small batch a dozen numpy calls on arrays of one element cost more than the loop.
    req_ids = [step.req_ids[i] for i in step.sample_idx.tolist()]
    n_tok = (step.sample_pos + step.num_emitted).tolist()
    k = spec.num_spec_tokens
    room, row_of = spec.max_model_len, ib.row_of
    most, ok_l = [], []
    for r, row, n in zip(req_ids, step.sample_rows.tolist(), n_tok):
        m = min(k, room - n) if slots is None else min(k, room - n, slots.get(r, 0))
        most.append(m)
        ok_l.append(m >= 1 and row_of.get(r, -1) == row)
    resume = getattr(proposer, "resume_at", None)
    if resume:  # requests that draft nothing yet are not asked; their hidden states wait
        waiting = [o and n < resume.get(r, 0) for o, r, n in zip(ok_l, req_ids, n_tok)]
        if any(waiting):
            ok_l = [o and not w for o, w in zip(ok_l, waiting)]
            if feed is not None:
                held = np.flatnonzero(waiting)
                feed.hold(step, held, np.asarray(n_tok)[held])
    if not any(ok_l):
        return
    # (all kept, the usual case: the runner's arange, no array built from the list)
    keep = spec.buffers.arange[: len(ok_l)] if all(ok_l) else np.flatnonzero(ok_l)
    num_tokens = np.asarray(n_tok, dtype=np.int64)
    max_drafts = np.asarray(most, dtype=np.int64)
    rows = step.sample_rows[keep]
    hidden = step.proposer_hidden
    if hidden is not None and len(keep) < len(hidden):  # (all kept: the rows as they are)
        hidden = hidden[spec.buffers.as_device(keep)]
    new_hidden = loc = None
    if feed is not None:
        new_hidden, loc = feed.take(step, keep, num_tokens[keep])
    batch = ProposalBatch(
        req_ids=[req_ids[i] for i in keep.tolist()],
        rows=rows,
        token_ids=ib.token_ids,
        num_tokens=num_tokens[keep],
        num_prompt_tokens=ib.num_prompt[rows],
        max_num_drafts=max_drafts[keep],
        hidden_states=hidden,
        new_hidden_states=new_hidden,
        hidden_loc=loc,
        # (with slots: the cost of the step they are for, at the batch size of the step read)
        slot_cost=None if slots is None else spec.slot_cost.cost(len(step.req_ids)),
    )
    drafts = proposer.propose(batch)
    counts = drafts.counts(spec.vocab_size, batch.max_num_drafts, k)
    ids = drafts.token_ids
    for i in np.flatnonzero(counts).tolist():
        req_id = batch.req_ids[i]
        into[req_id] = ids[i, : counts[i]].tolist()
        if drafts.probs is not None:
            spec.draft_probs[req_id] = drafts.probs[i, : counts[i]]
        else:
            spec.draft_probs.pop(req_id, None)
