"""The runner's side of LoRA: the wrapped model's adapter slots, which adapter each running
request uses, and each step's slot inputs (``pagoda.ops.lora.LoRABatch``) in persistent device
buffers, so that the decode graphs, captured with the LoRA path, replay with the step's slots."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagoda.config.model import LoRAConfig
from pagoda.lora.layers import LoRAContext, wrap_model
from pagoda.lora.slots import AdapterSlots
from pagoda.lora_request import LoRARequest
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
        # What the decode graphs capture: BGMV over ``token_slots``.
        self.graph_batch = LoRABatch(self.token_slots, self.seg_starts, self.seg_slots, 1, [], True)

    def add(self, req_id: str, lora: LoRARequest | None) -> None:
        if lora is None:
            self.of_req.pop(req_id, None)
        else:
            self.of_req[req_id] = lora

    def remove(self, req_id: str) -> None:
        self.of_req.pop(req_id, None)

    def prepare(
        self,
        req_ids: list[str],
        counts: np.ndarray,
        qsl: np.ndarray,
        graph_tokens: int | None,
    ) -> None:
        """Make the step's adapters resident and set its slots: for a graph replay of
        ``graph_tokens`` tokens (padding rows: no adapter), else for an eager forward."""
        loras: dict[int, LoRARequest] = {}
        ids = np.zeros(len(req_ids), dtype=np.int64)
        for i, rid in enumerate(req_ids):
            lora = self.of_req.get(rid)
            if lora is not None:
                loras[lora.lora_int_id] = lora
                ids[i] = lora.lora_int_id
        slot_of = self.slots.activate(loras) if loras else {}
        req_slots = np.fromiter((slot_of.get(int(i), -1) for i in ids), np.int32, len(ids))
        total = int(qsl[-1])
        if graph_tokens is not None:
            tok = np.full(graph_tokens, -1, dtype=np.int32)
            tok[:total] = np.repeat(req_slots, counts)
            self.buffers.to_device(self.token_slots[:graph_tokens], tok)
            self.context.batch = self.graph_batch
            return
        if not loras:
            self.context.batch = None  # the base path alone
            return
        n = len(req_ids)
        max_len = int(counts.max())
        if self.device.type == "cuda" and max_len == 1:  # decode rows: BGMV
            self.buffers.to_device(self.token_slots[:total], req_slots)
            self.context.batch = self.graph_batch
            return
        self.buffers.to_device(self.seg_starts[: n + 1], qsl.astype(np.int32))
        self.buffers.to_device(self.seg_slots[:n], req_slots)
        segments = [
            (int(qsl[i]), int(qsl[i + 1]), int(s)) for i, s in enumerate(req_slots) if s >= 0
        ]
        self.context.batch = LoRABatch(
            self.token_slots, self.seg_starts[: n + 1], self.seg_slots[:n], max_len, segments
        )
