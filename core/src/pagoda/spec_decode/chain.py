"""Chained speculation (``speculative.async_drafts: chain``): launch the next verification before
the one in flight is read, betting that all of its drafts are accepted.

With draft slots, a step that verifies drafts must be read before the next one is built: how
many drafts it accepts decides where the next step starts, and its last token is the next
step's first. At batch 1 that read puts the host's whole step preparation (proposing, building
inputs, planning attention) between two device steps. Chaining builds step N + 1 while step N
runs, on the assumption that N accepts every draft it verifies:

- N + 1 starts where N's last token lands if it does (``StepOutput.bonus_pos``); that token is
  still on the device, and N + 1 takes it there, as a plain decode step takes its input id;
- its drafts are proposed from the known history followed by N's drafts: the proposal's first
  token guesses N's last token, the ones after it are N + 1's drafts (a wrong guess only costs
  their acceptance: verification is exact whatever the drafts);
- once N is read, N + 1 is checked (``StepOutput._build``): if N accepted fewer drafts than it
  verified, N + 1 ran at the wrong positions and is *void*: it emits nothing, writes nothing to
  the host rows, and the scheduler takes its tokens back (``ModelRunnerOutput.voided``). Its
  keys and values lie past the request's true length, where the steps after it write first.

The step after a void one is built from the truth, which is on the host by then (the step
before the void one has been read). A void step costs one step, so a request bets on a step with
drafts only while its last verification accepted every draft (a copy in progress); otherwise
that launch waits, as with draft slots. A bet on a step without drafts always holds.

Only requests whose sampling reads nothing position-dependent from the host are chained: greedy,
without penalties, bad words, or a ``min_tokens`` still to reach (others fall back to draft
slots, which wait). The proposer must read token history only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagoda.spec_decode.inflight import is_slots
from pagoda.spec_decode.proposer import ProposalBatch

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.step import SchedulerOutput
    from pagoda.worker.model_runner import ModelRunner
    from pagoda.worker.step_output import StepOutput


def chain_drafts(config: EngineConfig) -> bool:
    """Whether speculation chains (``async_drafts: chain`` with async scheduling)."""
    return config.scheduler.async_scheduling and config.speculative.async_drafts == "chain"


@dataclass
class ChainPlan:
    """Where one request's next step starts and what it proposes from."""

    row: int
    start: int  # position of the step's first input token
    skip: int  # 1: a bet (the proposal's first token guesses the token at ``start``), 0: not
    premise: int  # the request's sampling index in the step bet on, or -1 (no bet)
    premise_drafts: int  # drafts the step bet on verified

    @property
    def history(self) -> int:
        """Tokens the proposal reads: up to the start, which a bet does not know yet."""
        return self.start + 1 - self.skip


def _eligible(runner: ModelRunner, row: int) -> bool:
    s = runner.input_batch.sampling
    if not s.greedy[row] or s.penalized[row] or s.bad_words.has[row]:
        return False
    ib = runner.input_batch
    # NOTE: the host's count may lag (tokens still in flight); it only ever lags behind.
    return int(ib.num_tokens[row] - ib.num_prompt[row]) >= int(s.min_tokens[row])


def plan_chain(
    runner: ModelRunner, last: StepOutput | None, so: SchedulerOutput
) -> dict[str, ChainPlan] | None:
    """Plans for every request of ``so`` with draft slots, without reading ``last`` (the step
    in flight); None when some request needs ``last`` read (then nothing is chained)."""
    spec = so.scheduled_spec_decode_tokens
    slots = [r for r, ids in spec.items() if is_slots(ids)]
    if not slots:
        return None
    ib = runner.input_batch
    if last is not None and last.done:
        last = None  # read already: every request's truth is on the host
    in_last: dict[str, int] = {}
    void = None
    if last is not None:
        for j, (i, row) in enumerate(zip(last.sample_idx.tolist(), last.sample_rows.tolist())):
            req_id = last.req_ids[i]
            if ib.row_of.get(req_id) == row:
                in_last[req_id] = j
        # A request of this step that verified drafts in ``last`` without a plan needs it read.
        if last.drafted is not None:
            drafted = {last.req_ids[last.sample_idx[j]] for j in np.flatnonzero(last.drafted)}
            if any(r in drafted and r not in spec for r in so.num_scheduled_tokens):
                return None
        # Rows of ``last`` known void already: they bet on a step (read by now) that lost.
        void = last.void()
    plans: dict[str, ChainPlan] = {}
    for req_id in slots:
        row = ib.row_of.get(req_id)
        if row is None or not _eligible(runner, row):
            return None
        j = in_last.get(req_id)
        if j is not None and (void is None or not void[j]):
            start = int(last.bonus_pos[j])
            nd = int(last.num_drafts[j]) if last.num_drafts is not None else 0
            if nd and not ib.all_accepted.get(req_id, True):
                # NOTE: a bet on drafts is lost at the first rejection; bet only while the
                # request's drafts keep being accepted whole (a copy in progress), else wait.
                return None
            plans[req_id] = ChainPlan(row, start, 1, j, nd)
        else:  # its last step was read, or is void: the truth is on the host
            n = int(ib.num_tokens[row])
            plans[req_id] = ChainPlan(row, n - 1, 0, -1, 0)
    return plans


def propose_chain(runner: ModelRunner, plans: dict[str, ChainPlan], spec: dict) -> None:
    """Drafts for the planned requests into ``runner._proposals`` (at most their slots each),
    and the step's first input token of each bet (-1: the device fills it) in the rows."""
    ib = runner.input_batch
    runner._proposals = {}
    req_ids = list(plans)
    rows = np.fromiter((plans[r].row for r in req_ids), np.int64, len(req_ids))
    history = np.fromiter((plans[r].history for r in req_ids), np.int64, len(req_ids))
    skip = np.fromiter((plans[r].skip for r in req_ids), np.int64, len(req_ids))
    want = np.fromiter((len(spec[r]) for r in req_ids), np.int64, len(req_ids)) + skip
    want = np.minimum(want, runner.max_model_len - history)
    for p in plans.values():
        if p.skip:  # the bet token: N's last, on the device (a plain row's placeholder already)
            ib.token_ids[p.row, p.start] = -1
    ok = want > skip
    if not ok.any() or runner.proposer is None:
        return
    keep = np.flatnonzero(ok)
    batch = ProposalBatch(
        req_ids=[req_ids[i] for i in keep.tolist()],
        rows=rows[keep],
        token_ids=ib.token_ids,
        num_tokens=history[keep],
        num_prompt_tokens=ib.num_prompt[rows[keep]],
        max_num_drafts=want[keep],
        hidden_states=None,
        new_hidden_states=None,
        hidden_loc=None,
    )
    drafts = runner.proposer.propose(batch)
    counts = drafts.counts(runner.arch.vocab_size, batch.max_num_drafts)
    ids = drafts.token_ids
    for n, i in enumerate(keep.tolist()):
        s = int(skip[i])
        if counts[n] > s:
            runner._proposals[req_ids[i]] = ids[n, s : counts[n]].tolist()


def write_chain_drafts(runner: ModelRunner, plans: dict[str, ChainPlan], drafts: dict) -> None:
    """Put each planned request's drafts after its start (``InputBatch.write_drafts`` puts them
    after the host's known tokens, which lag behind a bet)."""
    ib = runner.input_batch
    for req_id, p in plans.items():
        ids = drafts.get(req_id)
        if ids:
            ib.token_ids[p.row, p.start + 1 : p.start + 1 + len(ids)] = ids
