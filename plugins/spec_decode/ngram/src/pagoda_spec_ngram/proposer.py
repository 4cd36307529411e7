"""Prompt lookup: draft the tokens that followed the last occurrence of the request's latest
n-gram in its own prompt and output (vLLM's ``ngram`` method, same settings).

For each request, the longest suffix of ``prompt_lookup_min .. prompt_lookup_max`` tokens that
occurred before is found, and the up to ``num_speculative_tokens`` tokens after that occurrence
(the most recent one, among the longest matches) are the drafts. The whole batch is matched at
once: one vectorised comparison of the padded [requests, tokens] array with each request's last
token finds the candidate matches, and the longer suffixes are compared at those candidates
only; no Python loop over requests or tokens.
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
    ar = np.arange(n)
    hist = token_ids[rows, :width]
    # Candidate matches: windows ending at e with the history's last token, followed by at
    # least one known token (e <= num_tokens - 2). One pass over the batch; the longer suffixes
    # are compared at the candidates only, which are few in text.
    last = hist[ar, np.maximum(num_tokens - 1, 0)]
    eq = hist == last[:, None]
    eq &= np.arange(width)[None, :] <= (num_tokens - 2)[:, None]
    r, e = np.nonzero(eq)
    run = np.ones(len(r), dtype=np.int64)  # matched suffix length, up to max_n
    live = np.arange(len(r))
    for m in range(1, max_n):
        at = e[live] - m  # the window's m-th token from its end (>= 0: the suffix's is too)
        ok = at >= 0
        rr = r[live[ok]]
        ok[ok] = hist[rr, at[ok]] == hist[rr, num_tokens[rr] - 1 - m]
        live = live[ok]
        if not len(live):
            break
        run[live] += 1
    # The longest match wins, then one followed by k known tokens, then the most recent one.
    keep = run >= min_n
    r, e, run = r[keep], e[keep], run[keep]
    best = np.full(n, -1, dtype=np.int64)
    np.maximum.at(best, r, (2 * run + (e + k < num_tokens[r])) * width + e)
    found = best >= 0
    cols = np.arange(k)
    at = (best % width)[:, None] + 1 + cols[None, :]
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
        ids = ngram_drafts(
            batch.token_ids,
            batch.rows,
            batch.num_tokens,
            self.min_n,
            self.max_n,
            self.k,
            batch.max_num_drafts,
        )
        return Drafts(ids)
