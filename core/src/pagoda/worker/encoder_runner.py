"""The runner's side of multimodal inputs: the running requests' images, the encoder outputs it
holds (by image hash, until the scheduler's encoder cache evicts them), and each step's image
embeddings and rotary positions.

The scheduler says which images to encode in a step (``SchedulerOutput.scheduled_encoder_inputs``)
and which outputs to drop (``free_encoder_ids``); a step's placeholder tokens take rows of the
held outputs in place of their token embeddings. M-RoPE models (``uses_mrope``) get 3-D positions
in a step that computes prompt tokens under an image, and their 1-D positions shifted by the
request's delta otherwise (a decode step of them replays as any other).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.multimodal_inputs import MultiModalFeature, MultiModalInputs
from pagoda.step import SchedulerOutput


@dataclass
class MultiModalStep:
    """One step's multimodal inputs for the forward."""

    #: 1-D rotary positions ([tokens]) for the position buffer.
    positions: np.ndarray
    #: [3, tokens] on the device when some token has distinct M-RoPE rows, else None.
    positions_3d: torch.Tensor | None = None
    #: (flat indices of the placeholder tokens, their encoder rows), or None.
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def eager(self) -> bool:
        """Whether the step needs the model's own call (no decode graph takes these inputs)."""
        return self.positions_3d is not None or self.embeds is not None


class EncoderRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.mrope = bool(getattr(model, "uses_mrope", False))
        self.inputs: dict[str, MultiModalInputs] = {}
        self.outputs: dict[str, torch.Tensor] = {}  # image hash -> [tokens, hidden]

    def add(self, req_id: str, mm_inputs: MultiModalInputs | None) -> None:
        if mm_inputs is not None:
            self.inputs[req_id] = mm_inputs

    def forget(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.inputs.pop(req_id, None)

    def run(self, so: SchedulerOutput) -> None:
        """Drop the evicted outputs, then encode the images this step schedules."""
        for identifier in so.free_encoder_ids:
            self.outputs.pop(identifier, None)
        for req_id, todo in so.scheduled_encoder_inputs.items():
            features = self.inputs[req_id].features
            for i in todo:
                self._encode(features[i])

    def _encode(self, f: MultiModalFeature) -> torch.Tensor:
        out = self.outputs.get(f.identifier)
        if out is None:
            data = {k: torch.from_numpy(v).to(self.device) for k, v in f.data.items()}
            out = self.model.embed_multimodal(f.modality, data)
            if out.shape[0] != f.length:
                raise ValueError(
                    f"the encoder gave {out.shape[0]} rows for an image of {f.length} placeholder"
                    " tokens"
                )
            self.outputs[f.identifier] = out
        return out

    def step_inputs(
        self,
        req_ids: list[str],
        starts: np.ndarray,
        counts: np.ndarray,
        qsl: np.ndarray,
        positions: np.ndarray,
    ) -> MultiModalStep | None:
        """The step's image rows and rotary positions; None when no request has images."""
        if not self.inputs:
            return None
        rope = positions
        prompt_spans: list[tuple[slice, np.ndarray, MultiModalInputs]] = []
        idx: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        for j, req_id in enumerate(req_ids):
            mm = self.inputs.get(req_id)
            if mm is None:
                continue
            start, end = int(starts[j]), int(starts[j] + counts[j])
            for f in mm.features:
                lo, hi = max(start, f.offset), min(end, f.end)
                if lo < hi:  # (the held output; encoded now if it was not scheduled)
                    idx.append(np.arange(lo, hi) - start + qsl[j])
                    rows.append(self._encode(f)[lo - f.offset : hi - f.offset])
            if not self.mrope or mm.positions is None:
                continue
            span = slice(int(qsl[j]), int(qsl[j + 1]))
            if rope is positions:
                rope = positions.copy()
            rope[span] += mm.position_delta
            if start < mm.positions.shape[1]:  # prompt tokens: their three rows may differ
                prompt_spans.append((span, positions[span], mm))
        rope3 = None
        if prompt_spans:
            rope3 = np.broadcast_to(rope, (3, len(rope))).copy()
            for span, p, mm in prompt_spans:
                n = mm.positions.shape[1]
                inside = mm.positions[:, np.minimum(p, n - 1)]
                rope3[:, span] = np.where(p < n, inside, p + mm.position_delta)
        step = MultiModalStep(rope)
        if rope3 is not None:
            step.positions_3d = torch.from_numpy(rope3).to(self.device)
        if idx:
            flat = torch.from_numpy(np.concatenate(idx)).to(self.device)
            step.embeds = (flat, torch.cat(rows))
        return step
