"""The inverse-CDF draw of one token per row: the sampler's draw, and the fallback of the fused
one-kernel draw (:func:`pagoda.ops.sample_from_logits`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_CHUNK = 128  # tokens per first-level bucket of the inverse-CDF draw


def sample_from_probs(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: for each row the token i with ``cdf(i - 1) <= u * total < cdf(i)``, where
    ``probs`` need not sum to 1 and ``u`` is the row's ``uniform`` in [0, 1).

    Two levels of running sums in float64 (over the sums of buckets of 128 tokens, then within
    the chosen bucket), so float32 rounding of one long running sum distorts no token's chance,
    and a token of zero probability is never drawn. One uniform per row: far cheaper on a CPU than
    a random number per token.
    """
    n, vocab = probs.shape
    if vocab % _CHUNK:
        probs = F.pad(probs, (0, -vocab % _CHUNK))
    buckets = probs.view(n, -1, _CHUNK)
    bucket_cdf = buckets.sum(dim=-1).to(torch.float64).cumsum_(dim=-1)
    total = bucket_cdf[:, -1:]
    zero = torch.zeros_like(total)
    # NOTE: strictly below the total, so the chosen bucket and token have positive probability.
    target = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, zero))
    bucket = torch.searchsorted(bucket_cdf, target, right=True).clamp_(max=buckets.shape[1] - 1)
    before = torch.where(bucket > 0, bucket_cdf.gather(1, (bucket - 1).clamp(min=0)), zero)
    inner = buckets.gather(1, bucket.unsqueeze(2).expand(n, 1, _CHUNK)).squeeze(1)
    inner_cdf = inner.to(torch.float64).cumsum_(dim=-1)
    rest = torch.minimum(target - before, torch.nextafter(inner_cdf[:, -1:], zero))
    idx = torch.searchsorted(inner_cdf, rest, right=True).clamp_(max=_CHUNK - 1)
    return (bucket * _CHUNK + idx).squeeze(1).clamp_(max=vocab - 1)
