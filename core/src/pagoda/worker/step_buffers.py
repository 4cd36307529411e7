"""The persistent buffers a step's forward reads, and the copies that fill them.

Allocated once, at the largest step (``max_num_batched_tokens`` tokens, ``max_num_seqs``
requests), so that CUDA graphs captured over them replay any step that fits. The model runner
owns them and writes each step's flat batch into their first rows; the decode and verification
graphs, the profiling pass and a verification launched ahead read and write the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.worker import step_inputs_kernel
from pagoda.worker.pinned_stage import STAGED_DTYPES, PinnedStage


@dataclass
class StepBuffers:
    device: torch.device
    block_size: int
    input_ids: torch.Tensor  # [max tokens] int64
    positions: torch.Tensor  # [max tokens] int64
    slot_mapping: torch.Tensor  # [max tokens] int64: each token's KV cache slot
    query_start_loc: torch.Tensor  # [max requests + 1] int32
    seq_lens: torch.Tensor  # [max requests] int32
    block_table: torch.Tensor  # [max requests, max blocks a request] int32
    logits_indices: torch.Tensor  # [max requests] int64: the rows a step samples from
    arange: np.ndarray  # 0 .. max(tokens, requests), int64, on the host
    # On CUDA, the page-locked staging regions host-to-device copies go through (None: CPU).
    stage: PinnedStage | None
    # On CUDA, where :meth:`copy_inputs` copies a step's packed inputs (grown as needed).
    packed: torch.Tensor | None = None
    # :meth:`uniform_step`'s views of the buffers, by (requests, tokens a request)
    _uniform: dict = field(default_factory=dict)

    @classmethod
    def allocate(
        cls,
        device: torch.device,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
    ) -> StepBuffers:
        n, r = max_num_tokens, max_num_reqs
        i64 = {"dtype": torch.int64, "device": device}
        i32 = {"dtype": torch.int32, "device": device}
        return cls(
            device=device,
            block_size=block_size,
            input_ids=torch.zeros(n, **i64),
            positions=torch.zeros(n, **i64),
            slot_mapping=torch.zeros(n, **i64),
            query_start_loc=torch.zeros(r + 1, **i32),
            seq_lens=torch.zeros(r, **i32),
            block_table=torch.zeros(r, max_blocks_per_req, **i32),
            logits_indices=torch.zeros(r, **i64),
            arange=np.arange(max(n, r) + 1, dtype=np.int64),
            stage=PinnedStage() if device.type == "cuda" else None,
        )

    @property
    def max_num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    def next_launch(self) -> None:
        """A new step's launch: its copies take the next staging region."""
        if self.stage is not None:
            self.stage.next_launch()

    def to_device(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """Copy ``src`` into the buffer view ``dst`` without making the host wait: on CUDA
        through page-locked memory (the launch's staging region, or a pinned block the allocator
        keeps until the copy has run)."""
        dst.copy_(self._host(src), non_blocking=True)

    def copy_inputs(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
    ) -> None:
        """A step's inputs into the first rows of their buffers (``block_table``: [requests,
        columns], into the first columns): on CUDA in one copy and one kernel
        (:mod:`pagoda.worker.step_inputs_kernel`), else each by :meth:`to_device`."""
        n_tok, n_req = len(input_ids), len(seq_lens)
        cols = block_table.shape[1]
        if not step_inputs_kernel.available(self.device):
            self.to_device(self.input_ids[:n_tok], input_ids)
            self.to_device(self.positions[:n_tok], positions)
            self.to_device(self.slot_mapping[:n_tok], slots)
            self.to_device(self.query_start_loc[: n_req + 1], query_start_loc.astype(np.int32))
            self.to_device(self.seq_lens[:n_req], seq_lens.astype(np.int32))
            self.to_device(self.block_table[:n_req, :cols], block_table)
            return
        host = step_inputs_kernel.pack(
            input_ids, positions, slots, query_start_loc, seq_lens, block_table
        )
        if self.packed is None or len(self.packed) < len(host):
            self.packed = torch.empty(max(len(host), 4096), dtype=torch.int64, device=self.device)
        self.to_device(self.packed[: len(host)], host)
        out = (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
        )
        step_inputs_kernel.unpack(self.packed, out, n_tok, n_req, cols)

    def as_device(self, a: np.ndarray) -> torch.Tensor:
        """A new device tensor holding ``a``, copied like :meth:`to_device`."""
        return self._host(a).to(self.device, non_blocking=True)

    def staged(self, a: np.ndarray) -> torch.Tensor:
        """``a`` on the host as the source of a non-blocking copy into a device buffer the caller
        owns (page-locked on CUDA, as :meth:`to_device` copies from)."""
        return self._host(a)

    def _host(self, a: np.ndarray) -> torch.Tensor:
        if self.stage is not None and a.dtype in STAGED_DTYPES:
            t = self.stage.host(a)
            if t is not None:
                return t
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t.pin_memory() if self.stage is not None else t

    def uniform_step(self, n: int, q: int, seq_lens: np.ndarray) -> CommonAttentionMetadata:
        """A step of ``n`` requests of ``q`` tokens each whose inputs are in these buffers (a
        decode or verification graph's); ``seq_lens`` [n] on the host (an upper bound where no
        backend re-plans before a replay)."""
        # (the views made once per shape: slicing four tensors is host time on a batch-1
        # verification's critical path)
        views = self._uniform.get((n, q))
        if views is None:
            qsl_cpu = self.arange[: n + 1] * q
            qsl_cpu.setflags(write=False)
            views = self._uniform[(n, q)] = (
                self.query_start_loc[: n + 1],
                self.seq_lens[:n],
                self.block_table[:n],
                self.slot_mapping[: n * q],
                qsl_cpu,
            )
        qsl, lens, table, slots, qsl_cpu = views
        return CommonAttentionMetadata(
            num_reqs=n,
            num_actual_tokens=n * q,
            max_query_len=q,
            max_seq_len=int(seq_lens.max()),
            query_start_loc=qsl,
            seq_lens=lens,
            block_table=table,
            slot_mapping=slots,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
        )
