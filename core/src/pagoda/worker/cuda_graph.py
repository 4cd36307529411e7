"""Decode steps as replayed CUDA graphs over the model runner's persistent buffers.

One graph per batch-size bucket, captured largest first into one memory pool. A decode step with
``n`` requests replays the smallest bucket that holds them; rows past ``n`` are padding that
writes its key and value into block 0 (never handed out) and attends to that one slot.

With ``query_len`` q > 1 the same holds for steps where every request has q tokens (speculative
verification: the last known token and k drafts, q = k + 1); the runner pads requests with
fewer drafts to q tokens whose keys and values go to block 0 (``pagoda.worker.spec_verify``).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from pagoda.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagoda.attention.layer import set_forward_context
from pagoda.worker.step_buffers import StepBuffers

logger = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (which is always included)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    """Graphs of ``model`` over ``buffers`` for steps of ``query_len`` tokens a request, up to as
    many requests as the buffers hold."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: type[AttentionBackend],
        buffers: StepBuffers,
        max_model_len: int,
        query_len: int = 1,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.query_len = q = query_len
        self.buckets = graph_buckets(min(buffers.max_num_reqs, buffers.max_num_tokens // q))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metadata: dict[int, object] = {}  # the attention metadata each graph captured
        self.replays = 0
        # The buckets whose graphs the backend re-plans before a replay (the padded step is
        # built only for those), known once they are captured.
        self._replan: set[int] = set()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def replans(self) -> bool:
        """Whether any of the graphs needs the backend's ``prepare_graph_replay``."""
        return bool(self._replan)

    def _metadata(self, b: int) -> object:
        # NOTE: captured with worst-case lengths, so launch parameters baked into the graph
        # (grids, context splits) hold for every step it replays.
        common = self.buffers.uniform_step(b, self.query_len, np.full(b, self.max_model_len))
        return self.attn_backend.build_graph_metadata(common)

    def _pad(self, n: int, b: int) -> None:
        """Fill the buffers' rows of requests ``n .. b`` for a replay of bucket ``b`` with ``n``
        real requests (whose rows, query start locations included, the caller wrote)."""
        if n == b and n:
            return  # NOTE: nothing to pad; every write below would be an empty launch
        r, q = self.buffers, self.query_len
        r.input_ids[n * q : b * q] = 0
        r.positions[n * q : b * q] = 0
        r.slot_mapping[n * q : b * q] = 0
        r.seq_lens[n:b] = q
        r.block_table[n:b, : -(-q // r.block_size)] = 0
        r.query_start_loc[: b + 1].copy_(self._arange[: b + 1] * q)

    @torch.inference_mode()
    def capture(self) -> float:
        r, model = self.buffers, self.model
        self._arange = torch.arange(self.max_batch + 1, dtype=torch.int32, device=r.device)
        self._arange_np = np.arange(self.max_batch + 1, dtype=np.int64)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        q = self.query_len
        for b in reversed(self.buckets):
            self._pad(0, b)
            md = self.metadata[b] = self._metadata(b)
            if self.attn_backend.graph_replans(md):
                self._replan.add(b)
            with set_forward_context(md):
                model(r.input_ids[: b * q], r.positions[: b * q])  # warm-up: compile, tune
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[b] = model(r.input_ids[: b * q], r.positions[: b * q])
            self.graphs[b] = graph
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        logger.info(
            "captured %d decode CUDA graphs (batch %s, %d tokens a request) in %.1f s",
            len(self.buckets),
            self.buckets,
            q,
            elapsed,
        )
        return elapsed

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def run(self, common: CommonAttentionMetadata, b: int) -> torch.Tensor:
        """Replay bucket ``b`` for the step ``common`` (its ``num_reqs`` requests are in the
        buffers); their hidden states."""
        n, q = common.num_reqs, self.query_len
        self._pad(n, b)
        if b in self._replan:
            pad_lens = np.full(b - n, q, dtype=np.int64)
            r = self.buffers
            padded = dataclasses.replace(
                common,
                num_reqs=b,
                num_actual_tokens=b * q,
                query_start_loc=r.query_start_loc[: b + 1],
                seq_lens=r.seq_lens[:b],
                block_table=r.block_table[:b],
                slot_mapping=r.slot_mapping[: b * q],
                query_start_loc_cpu=self._arange_np[: b + 1] * q,
                seq_lens_cpu=np.concatenate([common.seq_lens_cpu, pad_lens]),
            )
            self.attn_backend.prepare_graph_replay(self.metadata[b], padded)
        self.replays += 1
        self.graphs[b].replay()
        return self.outputs[b][: n * q]
