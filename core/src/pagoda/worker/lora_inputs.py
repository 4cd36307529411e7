"""The runner's side of LoRA: the wrapped model's adapter slots, which adapter each running
request uses, and each step's slot inputs (``pagoda.ops.lora.LoRABatch``) in persistent device
buffers, so that the decode graphs, captured with the LoRA path, replay with the step's slots."""

from __future__ import annotations

from itertools import repeat
from typing import Any

import numpy as np
import torch

from pagoda.config.model import LoRAConfig
from pagoda.lora.layers import LoRAContext, wrap_model
from pagoda.lora.slots import AdapterSlots
from pagoda.lora_request import LoRARequest
from pagoda.ops import lora as lora_ops
from pagoda.ops.lora import LoRABatch
from pagoda.worker.step_buffers import StepBuffers


class LoRAInputs:
    def __init__(
        self,
        config: LoRAConfig,
        model: torch.nn.Module,
        model_config: Any,
        buffers: StepBuffers,
        device: torch.device,
    ) -> None:
        self.context = LoRAContext()
        layers = wrap_model(model, self.context, config.max_loras, config.max_lora_rank)
        self.slots = AdapterSlots(
            layers, model_config, config.max_loras, config.max_lora_rank, config.cpu_capacity
        )
        self.buffers = buffers
        self.device = device
        self.of_req: dict[str, LoRARequest] = {}
        i32 = {"dtype": torch.int32, "device": device}
        self.token_slots = torch.full((buffers.max_num_tokens,), -1, **i32)
        self.seg_starts = torch.zeros(buffers.max_num_reqs + 1, **i32)
        self.seg_slots = torch.full((buffers.max_num_reqs,), -1, **i32)
        # The rows grouped by slot, for the decode kernel that reads them (``fused-slots``).
        self.sorts = lora_ops.DECODE_KERNEL == "fused-slots"
        self.sorted_rows = torch.zeros(buffers.max_num_tokens, **i32)
        self.slot_starts = torch.zeros(config.max_loras + 1, **i32)
        # What the decode graphs capture: BGMV over ``token_slots``.
        self.graph_batch = LoRABatch(
            self.token_slots, self.seg_starts, self.seg_slots, 1, [], True,
            self.sorted_rows, self.slot_starts,
        )  # fmt: skip
        # The last rows step's inputs, still in the device buffers: a decode step of the same
        # requests (most of them) sets its batch and uploads nothing.
        self._last: tuple | None = None
        self._changes = 0  # requests added or removed
        self._id_of: dict[str, int] = {}  # request -> its adapter's id (ids start at 1)
        self._by_id: dict[int, LoRARequest] = {}
        # Requests whose adapter could not be loaded, and why: the step's output reports them.
        self.failed: dict[str, str] = {}

    def add(self, req_id: str, lora: LoRARequest | None) -> None:
        self._changes += 1
        if lora is None:
            self.of_req.pop(req_id, None)
            self._id_of.pop(req_id, None)
        else:
            self.of_req[req_id] = lora
            self._id_of[req_id] = lora.lora_int_id
            self._by_id[lora.lora_int_id] = lora

    def take_failures(self) -> dict[str, str]:
        """The requests failed since the last call (request -> why)."""
        failed, self.failed = self.failed, {}
        return failed

    def remove(self, req_id: str) -> None:
        self._changes += 1
        self.of_req.pop(req_id, None)
        self._id_of.pop(req_id, None)

    def prepare(
        self,
        req_ids: list[str],
        counts: np.ndarray,
        qsl: np.ndarray,
        graph_tokens: int | None,
    ) -> None:
        """Make the step's adapters resident and set its slots: for a graph replay of
        ``graph_tokens`` tokens (padding rows: no adapter), else for an eager forward."""
        last = self._last
        if (
            last is not None
            and last[0] == graph_tokens
            and last[1] == (self._changes, self.slots.version)
            and last[2] == req_ids
            and np.array_equal(last[3], counts)
        ):
            self.context.batch = last[4]
            return
        self._last = None
        ids = list(map(self._id_of.get, req_ids, repeat(0)))  # NOTE: no per-row Python
        loras = dict.fromkeys(ids)  # in the order the step first uses them
        loras.pop(0, None)
        slot_of = self.slots.activate({i: self._by_id[i] for i in loras}) if loras else {}
        failures = self.slots.failures if loras else {}
        if failures:  # their rows run without an adapter this once; the requests fail
            self.failed.update((r, failures[i]) for r, i in zip(req_ids, ids) if i in failures)
            slot_of.update(dict.fromkeys(failures, -1))
            loras = {i: None for i in loras if i not in failures}
        slot_of[0] = -1
        req_slots = np.array(list(map(slot_of.__getitem__, ids)), dtype=np.int32)
        total = int(qsl[-1])
        if graph_tokens is not None:
            tok = np.full(graph_tokens, -1, dtype=np.int32)
            tok[:total] = np.repeat(req_slots, counts)
            self._set_rows(tok)
        elif not loras:
            self.context.batch = None  # the base path alone
        elif self.device.type == "cuda" and int(counts.max()) == 1:  # decode rows: BGMV
            self._set_rows(req_slots)
        else:
            n = len(req_ids)
            self.buffers.to_device(self.seg_starts[: n + 1], qsl.astype(np.int32))
            self.buffers.to_device(self.seg_slots[:n], req_slots)
            starts = qsl[:-1][req_slots >= 0].tolist()
            ends = qsl[1:][req_slots >= 0].tolist()
            segments = list(zip(starts, ends, req_slots[req_slots >= 0].tolist()))
            self.context.batch = LoRABatch(
                self.token_slots, self.seg_starts[: n + 1], self.seg_slots[:n],
                int(counts.max()), segments,
            )  # fmt: skip
            return
        if failures:
            return  # (not kept for the next step: the adapter is tried again there)
        state = (self._changes, self.slots.version)
        self._last = (graph_tokens, state, list(req_ids), counts.copy(), self.context.batch)

    def _set_rows(self, tok: np.ndarray) -> None:
        """A rows step: ``tok`` [tokens], each token's slot, into the device buffers."""
        n = len(tok)
        self.buffers.to_device(self.token_slots[:n], tok)
        if self.sorts:
            rows, starts = lora_ops.sort_rows(tok, self.slots.num_slots)
            self.buffers.to_device(self.sorted_rows[:n], rows)
            self.buffers.to_device(self.slot_starts, starts)
        self.context.batch = self.graph_batch
