"""Prompt lookup: draft the tokens that followed the last occurrence of the request's latest
n-gram in its own prompt and output (vLLM's ``ngram`` method, same settings).

For each request, the longest suffix of ``prompt_lookup_min .. prompt_lookup_max`` tokens that
occurred before is found, and the up to ``num_speculative_tokens`` tokens after that occurrence
(the most recent one, among the longest matches) are the drafts. The whole batch is matched at
once over a padded [requests, tokens] array: one vectorised comparison per n-gram length, no
Python loop over requests or tokens.
"""

from __future__ import annotations

import numpy as np

from pagoda.spec_decode import Drafts, ProposalBatch, ProposerContext, SpeculativeProposer

_DEFAULT_LOOKUP = 5  # vLLM's, when neither prompt_lookup_min nor prompt_lookup_max is set


def lookup_range(lo: int | None, hi: int | None) -> tuple[int, int]:
    """vLLM's defaults: neither set -> 5 and 5; one set -> both equal to it."""
    if lo is None and hi is None:
        return _DEFAULT_LOOKUP, _DEFAULT_LOOKUP
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if lo < 1 or hi < lo:  # type: ignore[operator]
        raise ValueError(
            f"ngram: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}"
        )
    return int(lo), int(hi)  # type: ignore[arg-type]


def ngram_drafts(
    token_ids: np.ndarray,
    rows: np.ndarray,
    num_tokens: np.ndarray,
    min_n: int,
    max_n: int,
    k: int,
    max_num_drafts: np.ndarray | None = None,
) -> np.ndarray:
    """[n, k] int64 drafts (-1 where none) for rows ``rows`` of ``token_ids`` whose first
    ``num_tokens`` tokens are known."""
    n = len(rows)
    out = np.full((n, k), -1, dtype=np.int64)
    if n == 0 or k == 0:
        return out
    width = int(num_tokens.max())
    pos = np.arange(width)
    ar = np.arange(n)
    hist = token_ids[rows, :width]
    hist = np.where(pos[None, :] < num_tokens[:, None], hist, -2)
    # alive[i, e]: the window of the last m + 1 tokens ends at e (and at least one known token
    # follows it: e <= num_tokens - 2). Shifted slices, not gathers, keep each length one pass.
    alive = pos[None, :] <= (num_tokens - 2)[:, None]
    run = np.zeros((n, width), dtype=np.int32)
    for m in range(max_n):
        at = num_tokens - 1 - m
        suffix = np.where(at >= 0, hist[ar, np.maximum(at, 0)], -3)
        alive[:, :m] = False
        alive[:, m:] &= hist[:, : width - m] == suffix[:, None]
        if not alive.any():
            break
        run += alive
    # The longest match wins, then one followed by k known tokens, then the most recent one.
    full = pos[None, :] + k < num_tokens[:, None]
    score = np.where(run >= min_n, (2 * run + full) * width + pos[None, :], -1)
    best = score.argmax(axis=1)
    found = score[ar, best] >= 0
    cols = np.arange(k)
    at = best[:, None] + 1 + cols[None, :]
    ok = found[:, None] & (at < num_tokens[:, None])
    if max_num_drafts is not None:
        ok &= cols[None, :] < max_num_drafts[:, None]
    out[ok] = hist[ar[:, None], np.minimum(at, width - 1)][ok]
    return out


class NgramProposer(SpeculativeProposer):
    """No state between calls, no hidden states, no KV cache: history is all it reads."""

    def __init__(self, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.min_n, self.max_n = lookup_range(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        self.k = ctx.num_speculative_tokens

    def propose(self, batch: ProposalBatch) -> Drafts:
        # NOTE: chained speculation asks for one token more than k (its first is a guess).
        width = max(self.k, int(batch.max_num_drafts.max()) if len(batch) else 0)
        ids = ngram_drafts(
            batch.token_ids,
            batch.rows,
            batch.num_tokens,
            self.min_n,
            self.max_n,
            width,
            batch.max_num_drafts,
        )
        return Drafts(ids)
