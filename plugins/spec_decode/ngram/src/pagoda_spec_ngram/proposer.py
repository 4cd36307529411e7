"""Prompt lookup: draft the tokens that followed the last occurrence of the request's latest
n-gram in its own prompt and output (vLLM's ``ngram`` method, same settings).

For each request, the longest suffix of ``prompt_lookup_min .. prompt_lookup_max`` tokens that
occurred before is found, and the up to ``num_speculative_tokens`` tokens after that occurrence
(the most recent one, among the longest matches) are the drafts. The whole batch is matched at
once: one vectorised comparison of the padded [requests, tokens] array with each request's last
token finds the candidate matches, and the longer suffixes are compared at those candidates
only; no Python loop over requests or tokens.

At the defaults (none of ``num_speculative_tokens``, ``prompt_lookup_min`` and
``prompt_lookup_max`` given) suffixes of 1 to 8 tokens are matched and each request's draft
length, up to 8, is chosen from the acceptance measured per position and per match length and
from the measured cost of a draft token at the batch size (``pagoda_spec_ngram.adapt``), and a
request whose history keeps giving no draft pauses between probes (``pagoda.spec_decode.pause``:
its steps then launch without waiting for the step in flight).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from pagoda.config import SpeculativeConfig
from pagoda.spec_decode import (
    DraftPause,
    Drafts,
    ProposalBatch,
    ProposerContext,
    SpeculativeProposer,
    VerifiedBatch,
)
from pagoda_spec_ngram.adapt import DraftLengths
from pagoda_spec_ngram.device import ngram_drafts_device

_DEFAULT_LOOKUP = 5  # vLLM's, when neither prompt_lookup_min nor prompt_lookup_max is set
# With neither set the proposer matches suffixes of 1 to this many tokens, and measures from
# which match length drafting pays (``adapt``).
_AUTO_MAX_LOOKUP = 8


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


# Batches of at most this many requests are matched a request at a time by a byte search of its
# history (:func:`_match_one`): at batch 1 the vectorised pass is some 40 numpy calls, which cost
# more than the search (a request of a few hundred tokens: about 130 us against 20 on a CPU).
_SEARCH_MAX_BATCH = 4


def ngram_match(
    token_ids: np.ndarray,
    rows: np.ndarray,
    num_tokens: np.ndarray,
    min_n: int,
    max_n: int,
    k: int,
) -> tuple[np.ndarray, np.ndarray]:
    """For rows ``rows`` of ``token_ids`` whose first ``num_tokens`` tokens are known: where
    the chosen earlier occurrence of each history's suffix ends ([n] int64, -1: none of at
    least ``min_n`` tokens), and how long the match is ([n] int64, up to ``max_n``)."""
    n = len(rows)
    if n == 0:
        return np.full(0, -1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if n <= _SEARCH_MAX_BATCH:
        found = [
            _match_one(token_ids[r], int(m), min_n, max_n, k)
            for r, m in zip(rows.tolist(), num_tokens.tolist())
        ]
        return np.array([e for e, _ in found], np.int64), np.array([m for _, m in found], np.int64)
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
    end = np.where(found, best % width, -1)
    length = np.where(found, (best // width) // 2, 0)
    return end, length


def _match_one(row: np.ndarray, num: int, min_n: int, max_n: int, k: int) -> tuple[int, int]:
    """:func:`ngram_match` for one history (``row[:num]``), by searching its bytes from the end:
    for each suffix length from the longest down, the last occurrence followed by ``k`` known
    tokens, else the last one followed by at least one. The first length that occurs wins, as
    in the batch's ranking (longest, then followed by ``k``, then most recent)."""
    size = row.itemsize
    data = row[:num].tobytes()
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = data[(num - n) * size :]
        # occurrences ending at e <= num - 1 - k, then at e <= num - 2 (bytes up to e's end)
        for stop in ((num - k) * size, (num - 1) * size):
            start = _rfind_aligned(data, suffix, stop, size)
            if start >= 0:
                return start // size + n - 1, n
    return -1, 0


def _rfind_aligned(data: bytes, sub: bytes, stop: int, size: int) -> int:
    """The byte offset of the last occurrence of ``sub`` in ``data[:stop]`` that starts on a
    token boundary (a multiple of ``size``), or -1."""
    while stop >= len(sub):
        at = data.rfind(sub, 0, stop)
        if at < 0 or at % size == 0:
            return at
        stop = at + len(sub) - 1  # a match straddling tokens: look further left
    return -1


def drafts_after(
    token_ids: np.ndarray,
    rows: np.ndarray,
    num_tokens: np.ndarray,
    end: np.ndarray,
    lengths: np.ndarray,
    k: int,
) -> np.ndarray:
    """[n, k] int64: up to ``lengths`` known tokens after position ``end`` of each row (-1
    where none, and for ``end`` -1)."""
    n = len(rows)
    out = np.full((n, k), -1, dtype=np.int64)
    if n == 0 or k == 0:
        return out
    if n <= _SEARCH_MAX_BATCH:  # a slice a request (the batch's arrays cost more at batch 1)
        for i, (r, e, m, cap) in enumerate(
            zip(rows.tolist(), end.tolist(), num_tokens.tolist(), lengths.tolist())
        ):
            if e >= 0:
                got = token_ids[r, e + 1 : min(e + 1 + min(cap, k), m)]
                out[i, : len(got)] = got
        return out
    cols = np.arange(k)
    at = end[:, None] + 1 + cols[None, :]
    ok = (end >= 0)[:, None] & (at < num_tokens[:, None]) & (cols[None, :] < lengths[:, None])
    width = token_ids.shape[1]
    out[ok] = token_ids[rows[:, None], np.clip(at, 0, width - 1)][ok]
    return out


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
    if len(rows) == 0 or k == 0:
        return np.full((len(rows), k), -1, dtype=np.int64)
    end, _ = ngram_match(token_ids, rows, num_tokens, min_n, max_n, k)
    caps = np.full(len(rows), k) if max_num_drafts is None else np.minimum(max_num_drafts, k)
    return drafts_after(token_ids, rows, num_tokens, end, caps, k)


class NgramProposer(SpeculativeProposer):
    """No hidden states, no KV cache: history is all it reads. With ``num_speculative_tokens``
    and the lookup keys unset it measures (``pagoda_spec_ngram.adapt``) and chooses each
    request's draft length and the shortest match it drafts from; each key given fixes its part
    (``prompt_lookup_min``/``max``: the window; ``num_speculative_tokens``: the length)."""

    proposes_on_host = True  # (history on the host only: drafts may come late)

    @classmethod
    def paces_itself(cls, config: SpeculativeConfig) -> bool:
        """With the draft length not given, each request's is chosen from what it pays."""
        return not config.draft_length_given

    def __init__(self, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.k = ctx.num_speculative_tokens
        window_given = cfg.prompt_lookup_min is not None or cfg.prompt_lookup_max is not None
        if window_given:
            self.min_n, self.max_n = lookup_range(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        else:
            self.min_n, self.max_n = 1, _AUTO_MAX_LOOKUP
        self.window_given = window_given
        self.adapt: DraftLengths | None = None
        if not (ctx.draft_length_given and window_given):
            self.adapt = DraftLengths(self.k, self.max_n, ctx.max_num_reqs)
        # Pauses where it paces itself (the draft length not given); with it given, every
        # request is asked every step, as vLLM asks.
        self.pause = None if ctx.draft_length_given else DraftPause(self.resume_at)
        # ``plugins.ngram.device_drafts``: the next drafts looked up on the device behind each
        # verification (``draft_after_verify``), for the runner to launch the next
        # verification before it reads the step (``drafts_ahead``).
        settings = ctx.plugin_settings("ngram")
        self.drafts_on_device = bool(settings.device_drafts)
        self.window = int(settings.device_window)
        if self.drafts_on_device and self.window < self.k + 2:  # (room for a step's k + 1)
            raise ValueError(
                f"plugins.ngram.device_window={self.window}: want at least "
                f"num_speculative_tokens + 2 = {self.k + 2}"
            )
        self._ahead: tuple[list[str], torch.Tensor, torch.Tensor] | None = None
        self._given: tuple | None = None  # the last call's, until ``settle`` records it
        self._pinned: list[torch.Tensor] | None = None  # (``_staging``, on CUDA)
        self._turn = 0

    def propose(self, batch: ProposalBatch) -> Drafts:
        self.settle()  # (the last call's bookkeeping, where the runner did not ask for it)
        rows, num_tokens, caps = batch.rows, batch.num_tokens, batch.max_num_drafts
        end, match = ngram_match(batch.token_ids, rows, num_tokens, self.min_n, self.max_n, self.k)
        adapt = self.adapt
        if adapt is None:
            return Drafts(drafts_after(batch.token_ids, rows, num_tokens, end, caps, self.k))
        # (a request new to its row: the time since the last call is not one step of these
        # requests, it holds the gap between requests, another's prefill or an idle engine)
        seen = bool(adapt.own(batch.req_ids, rows).all())
        adapt.observe(rows, batch.token_ids, num_tokens)
        lengths = adapt.lengths(rows, match, np.minimum(caps, self.k))
        if self.ctx.draft_length_given:  # the window adapts; every match drafts k
            lengths = np.where(lengths > 0, np.minimum(caps, self.k), 0)
        ids = drafts_after(batch.token_ids, rows, num_tokens, end, lengths, self.k)
        pause = self.pause
        # NOTE: with a request paused at the last call, steps may have run since without one.
        contiguous = seen and (pause is None or not pause.paused)
        # What was given, the pauses and the step's timing are recorded in ``settle``: after
        # the launch these drafts are for, off the host's critical path.
        self._given = (rows, ids, match, num_tokens, contiguous, batch.req_ids, batch.slot_cost)
        return Drafts(ids)

    def settle(self) -> None:
        """Record the last call's drafts (scored at the next call), its step's time and its
        requests' pauses."""
        if self._given is None:
            return
        rows, ids, match, num_tokens, contiguous, req_ids, slot_cost = self._given
        self._given = None
        self.adapt.gave(rows, ids, match, num_tokens, contiguous=contiguous)
        if self.pause is not None:
            self.pause.update(req_ids, num_tokens, ids[:, 0] >= 0, slot_cost)

    def draft_after_verify(self, batch: VerifiedBatch) -> None:
        """With ``device_drafts``: each verified request's next ``k`` drafts, looked up on the
        device in its history (the last ``device_window`` known tokens, then the step's
        accepted drafts and the target's token, still on the device). A lookup that finds
        fewer than ``k`` is filled with token 0: a verification launched ahead takes ``k``
        drafts a request, and a draft the target would not pick is rejected like any other."""
        self._ahead = None
        if batch.token_ids is None or not len(batch.req_ids):
            return
        k, window, n = self.k, self.window, len(batch.req_ids)
        dev = batch.tokens.device
        known = batch.first + 1  # tokens known before the step's own
        lo = np.maximum(known - (window - k - 1), 0)  # (room for the step's k + 1 after them)
        at = np.minimum(lo[:, None] + np.arange(window)[None, :], batch.token_ids.shape[1] - 1)
        # One copy to the device: each window, then its count of known tokens.
        host = self._staging(n, window + 1, dev)
        host[:, :window] = torch.from_numpy(batch.token_ids[batch.rows[:, None], at])
        host[:, window] = torch.from_numpy(known - lo)
        both = host.to(dev, non_blocking=True)
        hist, width = both[:, :window], both[:, window]
        cols = torch.arange(batch.tokens.shape[1], device=dev)
        pos = width.unsqueeze(1) + cols.unsqueeze(0)
        came = cols.unsqueeze(0) < batch.num_emitted.unsqueeze(1)
        hist.scatter_(1, pos, torch.where(came, batch.tokens, hist.gather(1, pos)))
        drafts, _ = ngram_drafts_device(hist, width + batch.num_emitted, self.min_n, self.max_n, k)
        drafts = drafts.clamp_(min=0)
        self._ahead = (list(batch.req_ids), drafts, drafts.to("cpu", non_blocking=True))

    def _staging(self, n: int, width: int, dev: torch.device) -> torch.Tensor:
        """A host [n, width] int64 buffer to copy from without making the host wait: on CUDA
        page-locked (a copy from pageable memory first waits for the stream, which here runs the
        verification), one of two used in turn (the one of the step before was read since)."""
        if dev.type != "cuda":
            return torch.empty(n, width, dtype=torch.int64)
        rows = self.ctx.max_num_reqs
        if self._pinned is None or self._pinned[0].shape[1] != width:
            self._pinned = [
                torch.empty(rows, width, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
        self._turn ^= 1
        return self._pinned[self._turn][:n]

    def drafts_ahead(
        self, req_ids: list[str], num_tokens: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The drafts ``draft_after_verify`` looked up for the step in flight, when that step
        verified exactly ``req_ids`` (in this order). The verification launched with them
        verifies these; what ``propose`` returns for that step once it is read is not used."""
        got = self._ahead
        if got is None or got[0] != req_ids:
            return None
        return got[1], got[2]

    def remove(self, req_ids: Iterable[str]) -> None:
        self.settle()
        req_ids = list(req_ids)
        if self._ahead is not None and not set(req_ids).isdisjoint(self._ahead[0]):
            self._ahead = None
        if self.adapt is not None:
            for req_id in req_ids:
                self.adapt.remove(req_id)
        if self.pause is not None:
            self.pause.forget(req_ids)
