"""What the n-gram proposer drafts: the tokens after the latest longest match of the history's
suffix, capped per request, with vLLM's defaults for the lookup range."""

from __future__ import annotations

import numpy as np
import pytest
from pagoda_spec_ngram.proposer import lookup_range, ngram_drafts


def _drafts(histories, min_n, max_n, k, caps=None):
    width = max(len(h) for h in histories) + 1
    ids = np.full((len(histories), width), -1, dtype=np.int64)
    for i, h in enumerate(histories):
        ids[i, : len(h)] = h
    n = np.array([len(h) for h in histories])
    cap = None if caps is None else np.array(caps)
    return ngram_drafts(ids, np.arange(len(histories)), n, min_n, max_n, k, cap).tolist()


def test_drafts_continue_the_match_of_the_suffix():
    assert _drafts([[1, 2, 3, 4, 5, 6, 1, 2, 3]], 2, 3, 4) == [[4, 5, 6, 1]]


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    h = [9, 2, 3, 7, 8, 1, 2, 3, 5, 5, 9, 2, 3]  # "9 2 3" at 0; "2 3" again at 5
    assert _drafts([h], 2, 3, 2) == [[7, 8]]


def test_among_equal_matches_the_most_recent_with_a_full_continuation_wins():
    h = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert _drafts([h], 2, 2, 2) == [[20, 21]]


def test_no_match_shorter_than_prompt_lookup_min_is_used():
    assert _drafts([[1, 2, 3, 9, 3]], 2, 3, 2) == [[-1, -1]]
    assert _drafts([[1, 2, 3, 9, 3]], 1, 3, 2) == [[9, 3]]


def test_drafts_stop_at_the_end_of_the_history_and_at_the_cap():
    h = [5, 6, 7, 5, 6]
    assert _drafts([h], 2, 2, 4) == [[7, 5, 6, -1]]
    assert _drafts([h, h], 2, 2, 4, caps=[1, 2]) == [[7, -1, -1, -1], [7, 5, -1, -1]]


def test_rows_of_a_batch_do_not_mix():
    a, b = [1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6, 4]
    together = _drafts([a, b, [8]], 2, 3, 3)
    assert together == [_drafts([a], 2, 3, 3)[0], _drafts([b], 2, 3, 3)[0], [-1, -1, -1]]


@pytest.mark.parametrize(
    ("lo", "hi", "want"),
    [(None, None, (5, 5)), (2, None, (2, 2)), (None, 4, (4, 4)), (2, 4, (2, 4))],
)
def test_lookup_range_defaults_are_vllms(lo, hi, want):
    assert lookup_range(lo, hi) == want


def test_a_lookup_range_upside_down_is_an_error():
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        lookup_range(4, 2)


def _reference(h, min_n, max_n, k, cap):
    """Prompt lookup spelled out for one history: every earlier window, its matched suffix
    length, the best by (length, followed by k known tokens, recency)."""
    best = None
    for e in range(len(h) - 1):
        run = 0
        while run < max_n and e - run >= 0 and h[e - run] == h[len(h) - 1 - run]:
            run += 1
        key = (run, e + k < len(h), e)
        if run >= min_n and (best is None or key > best):
            best = key
    drafts = [] if best is None else h[best[2] + 1 : best[2] + 1 + min(k, cap)]
    return drafts + [-1] * (k - len(drafts))


@pytest.mark.parametrize("seed", range(4))
def test_batches_match_the_spelled_out_lookup(seed):
    # Small vocabularies: many matches, ties and partial suffixes; histories of every length.
    rng = np.random.default_rng(seed)
    for _ in range(25):
        vocab, k = int(rng.integers(2, 12)), int(rng.integers(1, 7))
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        hists = [rng.integers(0, vocab, int(rng.integers(0, 40))).tolist() for _ in range(6)]
        caps = rng.integers(1, k + 1, len(hists)).tolist()
        want = [_reference(h, lo, hi, k, c) for h, c in zip(hists, caps)]
        assert _drafts(hists, lo, hi, k, caps) == want


@pytest.mark.parametrize("seed", range(4))
def test_small_batches_searched_a_request_at_a_time_match_the_batch_pass(seed, monkeypatch):
    """Batches of up to ``_SEARCH_MAX_BATCH`` requests are matched by a byte search of each
    history and their drafts sliced a request at a time; larger ones by the vectorised pass.
    Both give the same ends, lengths and drafts, on histories of few distinct tokens (many
    candidates) and of ids whose bytes repeat across token boundaries (256 = bytes 0 1 0 ...)."""
    from pagoda_spec_ngram import proposer as p

    rng = np.random.default_rng(seed)
    for _ in range(150):
        n, width = int(rng.integers(1, p._SEARCH_MAX_BATCH + 1)), int(rng.integers(2, 70))
        ids = rng.integers(0, int(rng.choice([2, 3, 7, 300])), (6, width + 4)).astype(np.int64)
        if rng.random() < 0.3:
            ids = (ids % 2) * 256 + 1
        rows = rng.choice(6, n, replace=False).astype(np.int64)
        num = rng.integers(1, width + 1, n).astype(np.int64)
        lo = int(rng.integers(1, 4))
        hi, k = lo + int(rng.integers(0, 6)), int(rng.integers(1, 9))
        caps = rng.integers(0, k + 2, n).astype(np.int64)
        end, length = p.ngram_match(ids, rows, num, lo, hi, k)
        drafts = p.drafts_after(ids, rows, num, end, caps, k)
        monkeypatch.setattr(p, "_SEARCH_MAX_BATCH", 0)  # the vectorised pass, for every size
        want_end, want_length = p.ngram_match(ids, rows, num, lo, hi, k)
        assert end.tolist() == want_end.tolist() and length.tolist() == want_length.tolist()
        assert drafts.tolist() == p.drafts_after(ids, rows, num, end, caps, k).tolist()
        monkeypatch.undo()
