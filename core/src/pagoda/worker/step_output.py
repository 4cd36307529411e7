"""A step's output while the device may still be computing it.

``ModelRunner.execute_model`` launches a step and returns a ``StepOutput`` at once: the sampled
ids and logprobs are being copied to the host behind the step's kernels, and an event marks where
the copies end. ``get()`` waits for that event (the step's one host sync), writes the sampled ids
into the runner's rows and builds the ``ModelRunnerOutput``. In between, the runner can prepare
and launch the next step, which reads those ids on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.sample.metadata import LogprobsTensors
from pagoda.scheduler.output import ModelRunnerOutput, PromptLogprobs

if TYPE_CHECKING:
    from pagoda.worker.input_batch import InputBatch


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
    sampled: torch.Tensor | None = None  # host copy of the sampled ids, in flight
    logprobs: LogprobsTensors | None = None  # host copies, in flight
    logprobs_ks: np.ndarray | None = None  # per sampling row: k asked, or -1
    prompt_logprobs: PromptLogprobsPart | None = None
    event: torch.cuda.Event | None = None
    _output: ModelRunnerOutput | None = None

    @property
    def done(self) -> bool:
        return self._output is not None

    def get(self) -> ModelRunnerOutput:
        """Wait for the step's copies, then its output (computed once)."""
        if self._output is None:
            if self.event is not None:
                self.event.synchronize()
            self._output = self._build()
        return self._output

    def _build(self) -> ModelRunnerOutput:
        out = ModelRunnerOutput(self.req_ids, [[] for _ in self.req_ids])
        if self.sampled is not None:
            tokens = self.sampled.numpy()
            self._write_back(tokens)
            for i, t in zip(self.sample_idx.tolist(), tokens.tolist()):
                out.sampled_token_ids[i] = [t]
        if self.logprobs is not None:
            arrays = self.logprobs.to_arrays()
            for j in np.nonzero(self.logprobs_ks >= 0)[0].tolist():
                req_id = self.req_ids[self.sample_idx[j]]
                out.logprobs[req_id] = arrays.select(j, j + 1, int(self.logprobs_ks[j]))
        part = self.prompt_logprobs
        if part is not None:
            arrays = part.tensors.to_arrays()
            for j, i in enumerate(part.want.tolist()):
                lo = int(part.first[j])
                chunk = arrays.select(lo, lo + int(part.n_pos[j]), int(part.ks[i]))
                out.prompt_logprobs[self.req_ids[i]] = PromptLogprobs(int(part.starts[i]), chunk)
        return out

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
