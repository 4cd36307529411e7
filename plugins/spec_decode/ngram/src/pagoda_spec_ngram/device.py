"""Prompt lookup on the device: the same match and drafts as :func:`ngram_drafts` (the host's),
computed by a fixed sequence of tensor operations over a window of each request's history.

Why: at batch 1 a verifying step waits for the step in flight, because the host makes the next
drafts from the tokens it accepts; a drafter on the device can run right behind the
verification, before the host reads it, and the next verification can then be launched ahead
(``pagoda.worker.drafts_ahead``, as EAGLE's drafts are). The shapes depend only on the window
and the batch, never on the data (no host synchronisation, nothing that varies between calls),
so a CUDA graph can capture the whole search.

The search, for a history ``h`` of ``num`` known tokens: an earlier occurrence ending at ``e``
(``e <= num - 2``: at least one known token follows it) matches the last ``run[e]`` tokens,
``run[e]`` being how many of ``h[e], h[e - 1], ...`` equal ``h[num - 1], h[num - 2], ...`` in a
row, at most ``max_n``. Among the occurrences with ``run >= min_n`` the longest wins, then one
followed by ``k`` known tokens, then the most recent, exactly the host's ranking; the drafts are
the up to ``k`` known tokens after it.
"""

from __future__ import annotations

import torch


def ngram_drafts_device(
    history: torch.Tensor,
    num_tokens: torch.Tensor,
    min_n: int,
    max_n: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``history`` [n, W] int64 (request ``i``'s first ``num_tokens[i]`` tokens, anything
    after them), ``num_tokens`` [n] int64 (``1 <= num_tokens <= W``). Returns ``(drafts,
    match)``: [n, k] int64 drafts (-1 where none) and [n] int64 match lengths (0: no match of
    at least ``min_n`` tokens)."""
    n, width = history.shape
    dev = history.device
    cols = torch.arange(width, device=dev)
    last = (num_tokens - 1).unsqueeze(1)  # [n, 1]
    # run[e]: consecutive matches of h[e - m] with h[num - 1 - m], m = 0, 1, ... < max_n.
    run = torch.zeros(n, width, dtype=torch.int64, device=dev)
    alive = torch.ones(n, width, dtype=torch.bool, device=dev)
    for m in range(max_n):
        at = cols - m  # [W]: the window's m-th token from its end
        here = history[:, at.clamp(min=0)]
        want = history.gather(1, (last - m).clamp(min=0))  # [n, 1]: the suffix's m-th
        alive &= (here == want) & (at >= 0).unsqueeze(0) & (last - m >= 0)
        run += alive
    ends_ok = cols.unsqueeze(0) <= last - 1  # e <= num - 2
    keep = ends_ok & (run >= min_n)
    followed = (cols.unsqueeze(0) + k) < num_tokens.unsqueeze(1)  # k known tokens after e
    score = (2 * run + followed) * width + cols.unsqueeze(0)
    best = torch.where(keep, score, torch.full_like(score, -1)).amax(dim=1)  # [n]
    found = best >= 0
    end = torch.where(found, best % width, torch.full_like(best, -1))
    match = torch.where(found, (best // width) // 2, torch.zeros_like(best))
    at = end.unsqueeze(1) + 1 + torch.arange(k, device=dev).unsqueeze(0)  # [n, k]
    ok = found.unsqueeze(1) & (at < num_tokens.unsqueeze(1))
    drafts = history.gather(1, at.clamp(max=width - 1))
    return torch.where(ok, drafts, torch.full_like(drafts, -1)), match
