"""From logits to the next token of each request, batched on the model's device.

Order: greedy fast path; else temperature, then top-k, top-p and min-p filtering, then one draw
per row by the exponential-race trick (``argmax(p / q)`` with ``q ~ Exp(1)``), which lets seeded
rows use their own generator while the rest share one call.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.sample.metadata import SamplingMetadata


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """``logits``: [num_reqs, vocab] float32. Returns [num_reqs] int64 token ids."""
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            return greedy
        logits = logits / md.temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1)
        if md.min_p is not None:
            probs = apply_min_p(probs, md.min_p)
        sampled = exponential_race(probs, md.generators)
        if md.all_random:
            return sampled
        return torch.where(md.greedy_mask, greedy, sampled)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf every logit outside the top k, then outside the smallest set whose
    probability reaches top p (the most likely token always stays)."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # Ascending order: the top k are the last k columns.
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return probs.div(q).argmax(dim=-1)
