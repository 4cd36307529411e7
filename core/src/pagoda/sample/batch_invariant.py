"""The sampler's random draw in batch-invariant mode: over chunks of a fixed number of rows.

Softmax, top-p's sums and the inverse-CDF draw reduce over a whole vocabulary row, and torch picks
how many threads share a row by how many rows there are. Cut into chunks of one shape (the last
padded by repeating row 0), each row is reduced the same way in any batch; the seeded uniforms
already depend only on a row's seed and position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.ops.batch_invariant import fixed_rows, sampler_rows
from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.ops import sample_from_probs


def sample_in_fixed_rows(
    logits: torch.Tensor,
    md: SamplingMetadata,
    probs: Callable[[torch.Tensor, SamplingMetadata], torch.Tensor],
) -> torch.Tensor:
    """One draw per row of processed ``logits`` from ``probs(logits, md)``: [rows] int64."""

    def draw(
        chunk: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor | None,
        top_p: torch.Tensor | None,
        min_p: torch.Tensor | None,
        uniform: torch.Tensor,
    ) -> torch.Tensor:
        sub = SamplingMetadata(
            all_greedy=False,
            all_random=True,
            temperature=temperature,
            top_k=top_k,
            max_top_k=md.max_top_k,
            top_p=top_p,
            min_p=min_p,
            uniform=uniform,
        )
        return sample_from_probs(probs(chunk, sub), uniform)

    rows = sampler_rows(logits.device)
    return fixed_rows(draw, rows, logits, md.temperature, md.top_k, md.top_p, md.min_p, md.uniform)
