"""Verification launched ahead: step N + 1's verification graph replays before step N is read.

With draft slots (``pagoda.worker.draft_slots``) a request whose step N verified drafts is
scheduled for step N + 1 as if all were accepted, and the runner reads N before building N + 1:
N's accepted count decides where N + 1 starts, and N's last token and the drafts made behind it
are N + 1's input ids. At batch 1 that read puts the host's whole preparation of N + 1 between two
device steps. A proposer that drafts on the device right after verification
(``SpeculativeProposer.draft_after_verify``) has N + 1's drafts on the device already, and N's
outcome is there too, so the inputs of N + 1's verification can be built there:

- each request starts at ``p = sample_pos_N - 1 + num_emitted_N`` (where N's last token lands),
  its positions are ``p .. p + k``, its sequence length ``p + k + 1``;
- its key and value slots come from its block table (the scheduler reserved blocks for the
  case that N accepts everything, the farthest N + 1 can reach);
- its input ids are N's last token (``tokens_N[num_emitted_N - 1]``) and the k drafts.

The runner enqueues that and the graph replay behind step N (:func:`plan_ahead` says whether the
step allows it, :func:`launch_ahead` does it), then reads N and does the rest of
N + 1's launch (sampling, verification, the next drafts) on the host as usual, with N + 1's true
start known by then: the device starts N + 1 as soon as N ends. Only the graph's inputs move to
the device; everything the host keeps (rows, positions, the hidden-state feed) is computed after
the read as before, and N + 1 verifies exactly the drafts its inputs hold, so output is what the
ordinary path gives.

It applies to steps where every request verified drafts in N, keeps its row and has all ``k``
draft slots (``q = k + 1`` tokens), and gets its drafts from ``SpeculativeProposer.drafts_ahead``
(a verification graph with no padding) or, from a proposer that reads only history, from the
host once N is read, the device waiting for them (``pagoda.worker.late_drafts``: each request's
own drafts, fewer than ``k`` where it has fewer, then filler that is never compared); the
attention backend must read sequence lengths on the device (no re-planning before a replay:
Triton, not FlashInfer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.step import SchedulerOutput, is_draft_slots
from pagoda.utils import cdiv
from pagoda.worker.draft_slots import paused
from pagoda.worker.speculation import Speculation
from pagoda.worker.step_output import StepOutput
from pagoda.worker.verify_inputs_kernel import build_inputs


@dataclass
class AheadPlan:
    """A verification that may launch before the step in flight, ``last``, is read."""

    last: StepOutput
    sel: np.ndarray  # [n]: each request's index among ``last``'s sampling rows
    rows: np.ndarray  # [n]: their rows
    reach: np.ndarray  # [n]: the farthest each reaches (``last`` accepts every draft)
    dev_drafts: torch.Tensor | None  # [n, k] on the device (``SpeculativeProposer.drafts_ahead``)
    host_drafts: torch.Tensor | None  # [n, k] on the host (in flight until ``last`` is read)
    late: bool = False  # the drafts come from the host once ``last`` is read (``late_drafts``)


@dataclass
class AheadLaunch:
    """A verification replayed before the step in flight was read."""

    req_ids: list[str]
    starts: np.ndarray  # the scheduler's starts (``ModelRunner._update_states``)
    drafts: torch.Tensor | None  # [n, k] on the host (in flight until the step before is read);
    # None: the host writes them once it is read (``late_drafts``)
    hidden: torch.Tensor  # [n * q, hidden]: the graph's output


def plan_ahead(spec: Speculation, so: SchedulerOutput) -> AheadPlan | None:
    """Whether ``so``'s verification graph can replay behind the step in flight, before it is
    read (see the module), with the drafts the proposer promises; None otherwise (nothing was
    done but asking the proposer)."""
    graphs = spec.verify_graphs
    in_flight = spec.in_flight
    if graphs is None or graphs.replans or not in_flight.unread:
        return None
    last = in_flight.unread[-1]
    if not _fits(spec, last, so):
        return None
    ib = spec.input_batch
    q = graphs.query_len
    req_ids = [c.req_id for c in so.scheduled_cached_reqs]
    n = len(req_ids)
    # Each request's index among the step in flight's sampling rows.
    at = {last.req_ids[i]: j for j, i in enumerate(last.sample_idx.tolist())}
    sel = np.fromiter((at.get(r, -1) for r in req_ids), dtype=np.int64, count=n)
    if (sel < 0).any():
        return None
    rows = last.sample_rows[sel]
    if any(ib.row_of.get(r) != row for r, row in zip(req_ids, rows.tolist())):
        return None
    if (last.num_drafts[sel] == 0).any():
        return None
    # The farthest N + 1 reaches: N accepts everything (what the scheduler reserved).
    reach = last.sample_pos[sel] + last.num_drafts[sel] + q
    if int(reach.max()) > spec.max_model_len:
        return None
    if spec.late is not None:
        # NOTE: a request that backs off gets no drafts when ``last`` is read: its step is a
        # plain decode step, which waits for nothing.
        if any(paused(spec, last, r) for r in req_ids):
            return None
        return AheadPlan(last, sel, rows, reach, None, None, late=True)
    got = spec.proposer.drafts_ahead(req_ids, last.sample_pos[sel] + 1)  # (a lower bound)
    if got is None:
        return None
    k = spec.num_spec_tokens
    if got[1].shape[-1] != k:  # the documented bound holds in this mode too: k columns exactly
        raise ValueError(
            f"a proposer's drafts_ahead returned {got[1].shape[-1]} draft columns; want "
            f"speculative.num_speculative_tokens={k}"
        )
    return AheadPlan(last, sel, rows, reach, *got)


def launch_ahead(
    spec: Speculation, plan: AheadPlan, req_ids: list[str], starts: np.ndarray
) -> AheadLaunch:
    """Build the planned verification's inputs on the device and replay its graph, behind the
    step in flight. The runner has settled its older steps and taken the step's new blocks into
    its rows (``req_ids``, ``starts``: what that gave)."""
    graphs, buffers, last = spec.verify_graphs, spec.buffers, plan.last
    q, n, sel = graphs.query_len, len(plan.sel), plan.sel
    bucket = graphs.bucket_for(n)
    full = n == len(last.sample_idx) and bool((sel == np.arange(n)).all())
    tokens, emitted = last.verified
    if not full:
        sel_t = buffers.as_device(sel)
        tokens, emitted = tokens[sel_t], emitted[sel_t]
    bs = buffers.block_size
    max_blocks = min(cdiv(int(plan.reach.max()), bs), buffers.block_table.shape[1])
    table = spec.input_batch.block_table[plan.rows, :max_blocks]
    buffers.to_device(buffers.block_table[:n, :max_blocks], table)
    base = buffers.as_device(last.sample_pos[sel] - 1)  # each one's first position in N
    if plan.late:  # (host drafts: None, or those written already, ``late_drafts``)
        drafts, host_drafts = spec.late.enqueue(n)
    else:
        drafts, host_drafts = plan.dev_drafts, plan.host_drafts
    out = (
        buffers.input_ids,
        buffers.positions,
        buffers.slot_mapping,
        buffers.seq_lens,
        buffers.query_start_loc,
    )
    build_inputs(tokens, emitted, base, drafts, buffers.block_table, bs, out)
    # NOTE: the host has only a bound of the lengths (no backend here reads them: none re-plans).
    hidden = graphs.run(buffers.uniform_step(n, q, plan.reach), bucket)
    spec.ahead_launches += 1
    return AheadLaunch(req_ids, starts, host_drafts, hidden)


def _fits(spec: Speculation, last: StepOutput, so: SchedulerOutput) -> bool:
    """Whether ``so`` is a step of requests that only go on (no request comes, leaves or moves
    its KV), each with all ``k`` draft slots, right after ``last``, a verification whose
    outcome is on the device."""
    if last.done or last.pending is not None or last.verified is None:
        return False
    if so.scheduled_new_reqs or so.finished_req_ids or so.kv_transfers is not None:
        return False
    if not so.scheduled_cached_reqs or spec.grammar.entries:
        return False
    k = spec.verify_graphs.query_len - 1
    scheduled = so.scheduled_spec_decode_tokens
    if len(scheduled) != len(so.scheduled_cached_reqs) or len(so.scheduled_cached_reqs) > (
        spec.verify_graphs.max_batch
    ):
        return False
    for c in so.scheduled_cached_reqs:
        ids = scheduled.get(c.req_id)
        if ids is None or len(ids) != k or not is_draft_slots(ids):
            return False
        if so.num_scheduled_tokens.get(c.req_id) != k + 1:
            return False
    return True


def take_drafts(spec: Speculation, ahead: AheadLaunch) -> None:
    """Once the step before is read: the drafts the replayed graph verifies fill the draft
    slots (``spec.proposals``), whatever the proposer returned when that step was read.
    (A new dict: the one there is also that step's output.) Drafts the host wrote after the
    read (``late_drafts``) are the proposer's own: nothing to take."""
    if ahead.drafts is None:
        return
    host = ahead.drafts.numpy().tolist()
    spec.proposals = {**spec.proposals, **dict(zip(ahead.req_ids, host))}


def check_ahead(
    spec: Speculation,
    input_ids: np.ndarray,
    positions: np.ndarray,
    slots: np.ndarray,
    seq_lens: np.ndarray,
    late_rows: np.ndarray | None = None,
) -> None:
    """Compare the inputs built on the device with those the host built once the step before
    was read (``Speculation.check_ahead``, for tests: it waits for the device). ``late_rows``:
    where each of the host's tokens is among the device's (late drafts, fewer than ``k`` for
    some request: the device's sequence lengths then count the filler too)."""
    n, total, r = len(seq_lens), len(positions), spec.buffers
    at = np.arange(total) if late_rows is None else late_rows
    got = {
        "input ids": (r.input_ids, input_ids),
        "positions": (r.positions, positions),
        "slots": (r.slot_mapping, slots),
    }
    if late_rows is None:
        got["sequence lengths"] = (r.seq_lens[:n], seq_lens)
    for what, (dev, host) in got.items():
        dev = dev.cpu().numpy().astype(np.int64)
        if what != "sequence lengths":
            dev = dev[at]
        if not np.array_equal(dev, host):
            raise RuntimeError(f"a verification launched ahead has {what} {dev}, not {host}")
