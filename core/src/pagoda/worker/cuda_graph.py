"""Decode steps as replayed CUDA graphs over the model runner's persistent buffers.

One graph per batch-size bucket, captured largest first into one memory pool. A decode step with
``n`` requests replays the smallest bucket that holds them; rows past ``n`` are padding that
writes its key and value into block 0 (never handed out) and attends to that one slot.

With ``query_len`` q > 1 the same holds for steps where every request has q tokens (speculative
verification: the last known token and k drafts, q = k + 1); the runner pads requests with
fewer drafts to q tokens whose keys and values go to block 0 (``pagoda.spec_decode.verify``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.attention.layer import set_forward_context

if TYPE_CHECKING:
    from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (which is always included)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, query_len: int = 1) -> None:
        # NOTE: not a strong reference: the runner holds these graphs, and a cycle would keep
        # the runner (its KV cache: most of the device) alive until a full garbage collection,
        # after its engine was dropped.
        self.runner = weakref.proxy(runner)
        self.query_len = q = query_len
        self.buckets = graph_buckets(min(runner.max_num_reqs, runner.max_num_tokens // q))
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
        r, q = self.runner, self.query_len
        # NOTE: captured with worst-case lengths, so launch parameters baked into the graph
        # (grids, context splits) hold for every step it replays.
        common = CommonAttentionMetadata(
            num_reqs=b,
            num_actual_tokens=b * q,
            max_query_len=q,
            max_seq_len=r.max_model_len,
            query_start_loc=r.query_start_loc[: b + 1],
            seq_lens=r.seq_lens[:b],
            block_table=r.block_table[:b],
            slot_mapping=r.slot_mapping[: b * q],
            query_start_loc_cpu=np.arange(b + 1) * q,
            seq_lens_cpu=np.full(b, r.max_model_len),
            block_size=r.block_size,
        )
        return r.attn_backend.build_graph_metadata(common)

    def _pad(self, n: int, b: int) -> None:
        """Fill the buffers' rows of requests ``n .. b`` for a replay of bucket ``b`` with ``n``
        real requests (whose rows, query start locations included, the caller wrote)."""
        if n == b and n:
            return  # NOTE: nothing to pad; every write below would be an empty launch
        r, q = self.runner, self.query_len
        r.input_ids[n * q : b * q] = 0
        r.positions[n * q : b * q] = 0
        r.slot_mapping[n * q : b * q] = 0
        r.seq_lens[n:b] = q
        r.block_table[n:b, : -(-q // r.block_size)] = 0
        r.query_start_loc[: b + 1].copy_(self._arange[: b + 1] * q)

    @torch.inference_mode()
    def capture(self) -> float:
        r = self.runner
        self._arange = torch.arange(self.max_batch + 1, dtype=torch.int32, device=r.device)
        self._arange_np = np.arange(self.max_batch + 1, dtype=np.int64)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        q = self.query_len
        for b in reversed(self.buckets):
            self._pad(0, b)
            md = self.metadata[b] = self._metadata(b)
            if r.attn_backend.graph_replans(md):
                self._replan.add(b)
            with set_forward_context(md):
                r.model(r.input_ids[: b * q], r.positions[: b * q])  # warm-up: compile, tune
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[b] = r.model(r.input_ids[: b * q], r.positions[: b * q])
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
            padded = dataclasses.replace(
                common,
                num_reqs=b,
                num_actual_tokens=b * q,
                query_start_loc=self.runner.query_start_loc[: b + 1],
                seq_lens=self.runner.seq_lens[:b],
                block_table=self.runner.block_table[:b],
                slot_mapping=self.runner.slot_mapping[: b * q],
                query_start_loc_cpu=self._arange_np[: b + 1] * q,
                seq_lens_cpu=np.concatenate([common.seq_lens_cpu, pad_lens]),
            )
            self.runner.attn_backend.prepare_graph_replay(self.metadata[b], padded)
        self.replays += 1
        self.graphs[b].replay()
        return self.outputs[b][: n * q]
