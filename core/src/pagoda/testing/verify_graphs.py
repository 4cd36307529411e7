"""Verification "graphs" for tests without CUDA: an engine's verifications launched ahead
(``pagoda.worker.drafts_ahead``) need captured graphs that read sequence lengths on the device;
:class:`EagerVerifyGraphs` stands in for them on a CPU by running the model eagerly over the
runner's buffers, as a replay reads them."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from pagoda.attention.layer import set_forward_context


class EagerVerifyGraphs:
    """``DecodeGraphs`` for ``query_len`` tokens a request without CUDA: ``run`` reads the same
    buffers a replay reads; sequence lengths come from the device buffer (a captured graph never
    reads the host's). Install with :func:`eager_verify_graphs`."""

    replans = False

    def __init__(self, runner: Any, query_len: int, max_batch: int = 4) -> None:
        self.runner = runner
        self.query_len = query_len
        self.buckets = list(range(1, max_batch + 1))
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, n: int) -> int | None:
        return n if n <= self.max_batch else None

    def run(self, common: Any, b: int) -> torch.Tensor:
        r, q, n = self.runner, self.query_len, common.num_reqs
        buffers = r.buffers
        seq_lens = buffers.seq_lens[:n].numpy().astype(np.int64)
        real = dataclasses.replace(
            common,
            max_seq_len=int(seq_lens.max()),
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=np.arange(n + 1) * q,
        )
        self.replays += 1
        with set_forward_context(r.attn_backend.build_metadata(real)):
            return r.model(buffers.input_ids[: n * q], buffers.positions[: n * q])


def eager_verify_graphs(llm: Any, max_batch: int = 4, check: bool = True) -> Any:
    """Give ``llm``'s (an ``LLM`` whose worker runs in this process) speculation eager
    verification graphs of ``k + 1`` tokens a request, so that verifications launch ahead on a
    CPU; with ``check``, the runner compares each such launch's inputs with those the host
    builds once the step before is read (it raises where they differ). Returns the runner."""
    runner = llm.engine.engine_core.executor.worker.model_runner
    spec = runner.spec
    spec.verify_graphs = EagerVerifyGraphs(runner, spec.num_spec_tokens + 1, max_batch)
    spec.check_ahead = check
    return runner
