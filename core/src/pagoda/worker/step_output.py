"""A step's output while the device may still be computing it.

``ModelRunner.execute_model`` launches a step and returns a ``StepOutput`` at once: the sampled
ids and logprobs are being copied to the host behind the step's kernels, and an event marks where
the copies end. ``get()`` waits for that event (the step's one host sync), writes the sampled ids
into the runner's rows and builds the ``ModelRunnerOutput``. In between, the runner can prepare
and launch the next step, which reads those ids on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.sample.metadata import LogprobsTensors
from pagoda.step import ModelRunnerOutput, PromptLogprobs

if TYPE_CHECKING:
    from pagoda.kv_offload.medium import OffloadMedium
    from pagoda.worker.input_batch import InputBatch
    from pagoda.worker.pooling import PooledStep


@dataclass
class PromptLogprobsPart:
    tensors: LogprobsTensors  # on the host (copies in flight until the event)
    want: np.ndarray  # indices into the step's requests
    first: np.ndarray  # first row of each in ``tensors``
    n_pos: np.ndarray
    starts: np.ndarray  # first predicting position of each
    ks: np.ndarray  # top-k asked by each


@dataclass
class StepOutput:
    input_batch: InputBatch
    req_ids: list[str]
    sample_idx: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sample_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sample_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Host copy of the sampled ids, in flight: [n], or [n, k + 1] with -1 padding when the step
    # verified drafts (each row: its accepted drafts, then the target's token).
    sampled: torch.Tensor | None = None
    logprobs: LogprobsTensors | None = None  # host copies, in flight
    logprobs_ks: np.ndarray | None = None  # per sampling row: k asked, or -1
    prompt_logprobs: PromptLogprobsPart | None = None
    event: torch.cuda.Event | None = None
    # Speculative steps: which sampling rows had drafts (those got no placeholder: their tokens
    # are appended at ``get``), and each one's first row in ``logprobs``.
    drafted: np.ndarray | None = None
    logprobs_starts: np.ndarray | None = None
    # Called with this and its output once the output is built (the proposer's turn).
    on_output: Callable[[StepOutput, ModelRunnerOutput], None] | None = None
    proposer_hidden: torch.Tensor | None = None  # [sampling rows, hidden], for the proposer
    # The step's rows of the hidden states the proposer asked for (``worker.hidden_states``).
    hidden_feed: tuple | None = None
    num_emitted: np.ndarray | None = None  # per sampling row, set by ``get``
    # KV offload: its copy jobs done by ``get`` are reported with this output (a step with no
    # tokens, run only for them, waits for them all).
    kv_offload: OffloadMedium | None = None
    draft_counts: dict[str, int] = field(default_factory=dict)  # draft slots filled, by request
    # The rest of the launch when the step's sampling waits for something the host is still
    # computing (a structured-output bitmask): the runner calls it before its next launch.
    pending: Callable[[], None] | None = None
    # Per sampling row: drafts verified (None: a step without drafts).
    num_drafts: np.ndarray | None = None
    # A step that verified drafts: its outcome on the device, (tokens [n, k + 1] with -1 past
    # each row's ``num_emitted``, num_emitted [n]), for a verification launched before this
    # step is read (``pagoda.worker.drafts_ahead``).
    verified: tuple[torch.Tensor, torch.Tensor] | None = None
    # Pooling requests whose prompt ended this step: their outputs, copied to the host.
    pooled: PooledStep | None = None
    failed: dict[str, str] | None = None  # requests the step could not serve, and why
    _output: ModelRunnerOutput | None = None

    @property
    def done(self) -> bool:
        return self._output is not None

    def get(self) -> ModelRunnerOutput:
        """Wait for the step's copies, then its output (computed once)."""
        if self._output is None:
            self.finish_launch()
            if self.event is not None:
                self.event.synchronize()
            self._output = self._build()
            if self.on_output is not None:
                self.on_output(self, self._output)
        return self._output

    def finish_launch(self) -> None:
        """Launch what the step left pending (once)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending()

    def _build(self) -> ModelRunnerOutput:
        out = ModelRunnerOutput(self.req_ids, [[] for _ in self.req_ids])
        if self.kv_offload is not None:
            out.kv_offload_done = self.kv_offload.poll(wait=not self.req_ids)
        out.draft_counts = self.draft_counts
        if self.pooled is not None:
            out.pooler_output = self.pooled.split()
        if self.failed:
            out.failed_requests = self.failed
        if self.sampled is not None:
            tokens = self.sampled.numpy()
            if tokens.ndim == 1:
                self.num_emitted = np.ones(len(tokens), dtype=np.int64)
                self._write_back(tokens)
                for i, t in zip(self.sample_idx.tolist(), tokens.tolist()):
                    out.sampled_token_ids[i] = [t]
            else:
                # (each row: its accepted drafts and the target's token, then -1 padding)
                kept = [[t for t in row if t >= 0] for row in tokens.tolist()]
                self.num_emitted = np.fromiter(map(len, kept), dtype=np.int64, count=len(kept))
                self._write_back_verified(tokens)
                for i, row in zip(self.sample_idx.tolist(), kept):
                    out.sampled_token_ids[i] = row
        if self.logprobs is not None:
            arrays = self.logprobs.to_arrays()
            starts = self.logprobs_starts
            for j in np.nonzero(self.logprobs_ks >= 0)[0].tolist():
                req_id = self.req_ids[self.sample_idx[j]]
                lo = j if starts is None else int(starts[j])
                hi = lo + int(self.num_emitted[j])
                out.logprobs[req_id] = arrays.select(lo, hi, int(self.logprobs_ks[j]))
        part = self.prompt_logprobs
        if part is not None:
            arrays = part.tensors.to_arrays()
            for j, i in enumerate(part.want.tolist()):
                lo = int(part.first[j])
                chunk = arrays.select(lo, lo + int(part.n_pos[j]), int(part.ks[i]))
                out.prompt_logprobs[self.req_ids[i]] = PromptLogprobs(int(part.starts[i]), chunk)
        return out

    def _write_back_verified(self, tokens: np.ndarray) -> None:
        """A step that verified drafts: rows without drafts replace their placeholder; rows
        with drafts gain their emitted tokens (the engine reads such a step before it schedules
        the request again, so nothing was appended to them since)."""
        ib = self.input_batch
        if len(tokens) <= 4:
            # NOTE: a few requests (batch 1, say): Python over each, not a dozen numpy calls
            # (on the host's path from reading a verification to releasing the next drafts).
            rows_l, pos_l = self.sample_rows.tolist(), self.sample_pos.tolist()
            for j, (i, drafted) in enumerate(zip(self.sample_idx.tolist(), self.drafted.tolist())):
                row, pos = rows_l[j], pos_l[j]
                if ib.row_of.get(self.req_ids[i]) != row:
                    continue  # ended or preempted: it gave its row up
                if not drafted:
                    if ib.token_ids[row, pos] < 0:
                        ib.token_ids[row, pos] = tokens[j, 0]
                    continue
                n = int(self.num_emitted[j])
                ib.token_ids[row, pos : pos + n] = tokens[j, :n]
                ib.num_tokens[row] = pos + n
            return
        plain = ~self.drafted
        if plain.any():
            sub = StepOutput(ib, self.req_ids, self.sample_idx[plain], self.sample_rows[plain])
            sub.sample_pos = self.sample_pos[plain]
            sub._write_back(tokens[plain, 0])
        drafted = np.flatnonzero(self.drafted)
        rows = self.sample_rows[drafted]
        owned = [
            ib.row_of.get(self.req_ids[i]) == r
            for i, r in zip(self.sample_idx[drafted].tolist(), rows.tolist())
        ]
        owned = np.asarray(owned, dtype=bool)
        drafted, rows = drafted[owned], rows[owned]
        n = self.num_emitted[drafted]
        pos = self.sample_pos[drafted]
        cols = np.arange(tokens.shape[1])
        keep = cols[None, :] < n[:, None]
        ib.token_ids[np.repeat(rows, n), (pos[:, None] + cols)[keep]] = tokens[drafted][keep]
        ib.num_tokens[rows] = pos + n

    def _write_back(self, tokens: np.ndarray) -> None:
        """Put the sampled ids in place of the placeholders the runner left in its rows, for
        the requests that still hold the same row (an ended or preempted one gave it up)."""
        ib = self.input_batch
        for j, i in enumerate(self.sample_idx.tolist()):
            row = int(self.sample_rows[j])
            if ib.row_of.get(self.req_ids[i]) == row:
                pos = int(self.sample_pos[j])
                if ib.token_ids[row, pos] < 0:
                    ib.token_ids[row, pos] = tokens[j]
