"""Per-step sampling settings of the requests that sample, as tensors on the model's device."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None  # [num_reqs] float32; greedy rows hold 1.0
    greedy_mask: torch.Tensor | None  # [num_reqs] bool
    top_k: torch.Tensor | None  # [num_reqs] int64, vocab size where disabled; None if none use it
    top_p: torch.Tensor | None  # [num_reqs] float32; None if none use it
    min_p: torch.Tensor | None  # [num_reqs] float32; None if none use it
    # Row index -> the request's own generator (seeded requests only).
    generators: dict[int, torch.Generator]
