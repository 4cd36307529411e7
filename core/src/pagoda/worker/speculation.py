"""The model runner's side of speculative decoding: what it keeps between steps, and what the
code that proposes, fills draft slots, verifies and launches verifications ahead works on.

The runner builds one :class:`Speculation` when a proposer is configured and hands it, instead
of itself, to ``pagoda.worker.spec_propose`` (asking the proposer), ``draft_slots`` (whether a
launch waits for the step in flight, and the drafts that fill a step's slots), ``spec_verify``
(scoring and verifying drafts) and ``drafts_ahead`` (a verification launched before the step in
flight is read).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from pagoda.sample.sampler import Sampler
from pagoda.spec_decode.proposer import SpeculativeProposer
from pagoda.structured_output.remote import RemoteGrammarRows
from pagoda.structured_output.runner import GrammarRows
from pagoda.worker.cuda_graph import DecodeGraphs
from pagoda.worker.greedy_verify_graphs import GreedyVerifyGraphs
from pagoda.worker.hidden_states import HiddenFeed
from pagoda.worker.input_batch import InputBatch
from pagoda.worker.late_drafts import LateDrafts
from pagoda.worker.slot_cost import SlotCost
from pagoda.worker.step_buffers import StepBuffers
from pagoda.worker.steps_in_flight import StepsInFlight


@dataclass
class Speculation:
    proposer: SpeculativeProposer
    num_spec_tokens: int  # k
    vocab_size: int
    max_model_len: int
    # The runner's own: its rows, step buffers, steps in flight, sampler and grammar rows.
    input_batch: InputBatch
    buffers: StepBuffers
    in_flight: StepsInFlight
    sampler: Sampler
    grammar: GrammarRows | RemoteGrammarRows
    # Whether the proposer is asked at a step's launch for that step's draft slots (it reads
    # only history, under async scheduling), besides after alternating steps' outputs.
    propose_in_launch: bool
    model: torch.nn.Module | None = None  # the target, once loaded (``bind``)
    # req_id -> the drafts proposed after the last step read (they fill draft slots).
    proposals: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> the proposer's q of the request's latest drafts, where it gave them.
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    hidden_feed: HiddenFeed | None = None  # the hidden states the proposer asked for
    # Verification steps (k + 1 tokens a request) as CUDA graphs, and all-greedy verifications
    # of small batches as graphs after them (None: eager).
    verify_graphs: DecodeGraphs | None = None
    greedy_graphs: GreedyVerifyGraphs | None = None
    # The rows of this launch's verification graph where it padded its requests (each request's
    # q rows, real ones first), else None; the greedy graphs verify these.
    verify_rows: torch.Tensor | None = None
    ahead_launches: int = 0  # verifications launched before the step in flight was read
    # A history proposer's drafts, written by the host once the step in flight is read, into
    # a verification launched before it (``pagoda.worker.late_drafts``); None: not here.
    late: LateDrafts | None = None
    # What a step with draft slots costs beyond one without, measured at each launch.
    slot_cost: SlotCost = field(default_factory=SlotCost)
    check_ahead: bool = False  # (tests) compare their inputs with the host's, waiting

    @property
    def needs_hidden_states(self) -> bool:
        return self.proposer.needs_hidden_states

    @property
    def drafts_after_verify(self) -> bool:
        """Whether the proposer drafts on the device behind each verification (a draft model,
        or a history proposer that ``drafts_on_device``): verifications may launch ahead."""
        return self.proposer.needs_hidden_states or self.proposer.drafts_on_device

    def forget(self, req_ids: Collection[str]) -> None:
        """Requests that finished, were aborted or preempted."""
        for req_id in req_ids:
            self.draft_probs.pop(req_id, None)
        if req_ids:
            self.proposer.remove(req_ids)
            if self.hidden_feed is not None:
                self.hidden_feed.remove(req_ids)
