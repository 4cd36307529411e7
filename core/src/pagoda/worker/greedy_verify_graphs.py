"""Greedy verification replayed as one CUDA graph after the verification graph.

A verification step whose requests are all plain greedy (no setting acts on the logits, no
logprobs) and that replayed a verification graph needs, after the target's forward, only this: the
logits of each request's ``k + 1`` graph rows, their argmax, the greedy comparison with the drafts
(:func:`pagoda.sample.rejection.rejection_sample`), each request's last token (what the next
step takes as its first input on the device) and the hidden state of its last emitted row (for
the proposer). Run eagerly that is about a dozen launches, each tens of microseconds of the
host's time on a step that is host-bound at small batches. :class:`GreedyVerifyGraphs` captures
them once
per verification-graph bucket, over that bucket's output rows and the input ids the verification
read (the drafts are those ids after each request's first), so such a step is two replays.
A request may verify fewer than ``k`` drafts (history proposers choose each request's length):
the verification graph padded its rows after the real ones, and the replay reads each
request's draft count from a buffer of its own, so the padded rows are never compared.

The graphs hold one logits buffer of the largest bucket they cover, so they cover small
batches only (``MAX_ROWS`` scored rows), where the host's time matters; larger steps take the
eager path, whose outputs are identical (same operations on the same rows).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagoda.sample.rejection import rejection_sample
from pagoda.worker.cuda_graph import DecodeGraphs

logger = logging.getLogger(__name__)

#: Scored rows (requests times k + 1) of the largest step the graphs cover.
MAX_ROWS = 64


@dataclass
class GreedyVerified:
    """A greedy verification's outcome on the device."""

    tokens: torch.Tensor  # [n, k + 1] int64: the accepted drafts, the target's token, then -1
    num_emitted: torch.Tensor  # [n] int64: accepted drafts + 1
    last_token: torch.Tensor  # [n] int64: the token at each request's draft count (-1 -> 0:
    # not every draft accepted); from a graph, a view of its buffer
    last_hidden: torch.Tensor  # [n, hidden]: the hidden state of each request's last emitted row


class GreedyVerifyGraphs:
    """Greedy verification of steps that fill a verification graph's bucket with ``n`` requests
    of ``q = k + 1`` tokens each (no padding inside a request). ``model``: the target (its
    ``compute_logits``); ``input_ids``: the buffer the verification graphs read their input ids
    from. ``graphs=False``: no capture, the same operations run eagerly on the given rows (CPU
    stand-ins of the graphs, in tests)."""

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        verify: DecodeGraphs,
        graphs: bool = True,
    ) -> None:
        self.model = model
        self.input_ids = input_ids
        self.verify = verify
        self.q = q = verify.query_len
        self.buckets = [b for b in verify.buckets if b * q <= MAX_ROWS]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.use_graphs = graphs
        self.replays = 0
        dev = input_ids.device
        b = max(self.buckets, default=0)
        self._num_drafts = torch.full((b,), q - 1, dtype=torch.int64, device=dev)
        self._starts = torch.arange(b, dtype=torch.int64, device=dev) * q

    @staticmethod
    def reserve_bytes(vocab_size: int, dtype: torch.dtype) -> int:
        """What the graphs keep on the device beyond their inputs: the logits of the largest
        step they cover, in the model's dtype and as float32 (the KV cache leaves room)."""
        return MAX_ROWS * vocab_size * (dtype.itemsize + 4)

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _compute(self, hidden: torch.Tensor, b: int) -> tuple[torch.Tensor, ...]:
        """The verification of ``b`` requests' ``b * q`` rows ``hidden`` (their input ids in the
        buffer, as the verification read them; their draft counts in ``_num_drafts``)."""
        q = self.q
        argmax = self.model.compute_logits(hidden).argmax(dim=-1)
        drafts = self.input_ids[: b * q].view(b, q)[:, 1:]
        num_drafts = self._num_drafts[:b]
        tokens, emitted = rejection_sample(argmax, None, drafts, num_drafts, self._starts[:b])
        last_token = tokens.gather(1, num_drafts.unsqueeze(1)).squeeze(1).clamp(min=0)
        last_hidden = hidden.view(b, q, -1)[torch.arange(b, device=hidden.device), emitted - 1]
        return tokens, emitted, last_token, last_hidden

    @torch.inference_mode()
    def capture(self) -> float:
        if not self.use_graphs:
            return 0.0
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            hidden = self.verify.outputs[b]
            self._compute(hidden, b)  # warm-up: compile, tune
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._compute(hidden, b)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        logger.info(
            "captured %d greedy verification CUDA graphs (batch %s) in %.1f s",
            len(self.buckets),
            self.buckets,
            elapsed,
        )
        return elapsed

    def run(
        self, hidden: torch.Tensor, n: int, num_drafts: torch.Tensor | None = None
    ) -> GreedyVerified | None:
        """Verify the step whose ``n`` requests' rows are ``hidden`` ([n * q, hidden], the
        verification graph's output as it left it, padded rows included); ``num_drafts``: [n]
        int64, each request's drafts (None: ``k`` each; on the host, page-locked, or on the
        device). None where no graph
        covers the step (then the caller verifies eagerly)."""
        b = self.bucket_for(n)
        if b is None or hidden.shape[0] != n * self.q:
            return None
        if self.use_graphs and hidden.data_ptr() != self.verify.outputs[b].data_ptr():
            return None  # not that bucket's rows as the graph left them
        # NOTE: a padding request's count stays as the last replay left it (0 .. k); its rows
        # are not returned.
        if num_drafts is None:
            self._num_drafts[:n].fill_(self.q - 1)
        else:
            self._num_drafts[:n].copy_(num_drafts, non_blocking=True)
        if not self.use_graphs:
            got = self._compute(hidden, n)
            self.replays += 1
            return GreedyVerified(*got)
        self.graphs[b].replay()
        self.replays += 1
        # NOTE: copies, but of the last token: the graph's buffers are overwritten by its next
        # replay, and the tokens and hidden states go to the proposer, which may keep them. The
        # last token is read (on the device) only by the next step's launch, before the next
        # replay: every verification replaces the runner's copy of it.
        tokens, emitted, last_token, last_hidden = self.outputs[b]
        return GreedyVerified(
            tokens[:n].clone(), emitted[:n].clone(), last_token[:n], last_hidden[:n].clone()
        )
