"""One step's grammar bitmask as the sampler applies it (a ``sample.metadata.LogitsMask``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.structured_output.backend import GrammarBackend


@dataclass
class GrammarMask:
    """One step's bitmask for the sampling rows that are constrained, on the logits' device;
    the sampler applies it to the processed logits (``Sampler.process_logits``)."""

    backend: type[GrammarBackend]
    bitmask: torch.Tensor  # [num sampling rows, words] int32; all ones where unconstrained
    rows: list[int]  # the constrained rows: indices into the step's sampling rows

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.backend.apply_bitmask(logits, self.bitmask, self.rows)
        return logits
