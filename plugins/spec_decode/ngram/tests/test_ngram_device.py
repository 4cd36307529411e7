"""``ngram_drafts_device``: the device's prompt lookup gives the host's match lengths and drafts
(``ngram_drafts``: longest match, then one followed by k known tokens, then the most recent),
for histories of few distinct tokens (many matches of every length), short histories, and
windows wider than the history."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagoda_spec_ngram.device import ngram_drafts_device
from pagoda_spec_ngram.proposer import ngram_drafts, ngram_match


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(1, 8, 8), (2, 5, 4), (3, 3, 2), (1, 1, 6)])
@pytest.mark.parametrize("vocab", [3, 12])
def test_device_lookup_is_the_hosts(min_n: int, max_n: int, k: int, vocab: int) -> None:
    rng = np.random.default_rng(min_n * 100 + max_n * 10 + k + vocab)
    width = 48
    for n in (1, 3, 9):  # (the host matches up to 4 requests by byte search, more vectorised)
        for _ in range(20):
            tokens = rng.integers(0, vocab, (n, width)).astype(np.int64)
            num = rng.integers(1, width + 1, n).astype(np.int64)
            rows = np.arange(n, dtype=np.int64)
            want = ngram_drafts(tokens, rows, num, min_n, max_n, k)
            _, want_match = ngram_match(tokens, rows, num, min_n, max_n, k)
            drafts, match = ngram_drafts_device(
                torch.from_numpy(tokens), torch.from_numpy(num), min_n, max_n, k
            )
            assert np.array_equal(match.numpy(), want_match), (tokens, num)
            assert np.array_equal(drafts.numpy(), want), (tokens, num)


def test_a_repeated_phrase_drafts_what_followed_it() -> None:
    phrase = [5, 6, 7, 8, 9, 10, 11]
    hist = torch.tensor([phrase + phrase[:3] + [0] * 6])
    drafts, match = ngram_drafts_device(hist, torch.tensor([10]), 1, 8, 4)
    assert match.tolist() == [3] and drafts.tolist() == [[8, 9, 10, 11]]
    # Nothing earlier ends with the last token: no drafts.
    drafts, match = ngram_drafts_device(torch.tensor([[1, 2, 3, 4]]), torch.tensor([4]), 1, 8, 4)
    assert match.tolist() == [0] and drafts.tolist() == [[-1] * 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_lookup_replays_from_a_cuda_graph() -> None:
    # Nothing in it waits for the host or depends on the data's values for its shapes: one
    # capture serves every step of the same window and batch.
    n, width, k = 4, 64, 8
    hist = torch.zeros(n, width, dtype=torch.int64, device="cuda")
    num = torch.ones(n, dtype=torch.int64, device="cuda")
    ngram_drafts_device(hist, num, 1, 8, k)  # warm-up, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drafts, match = ngram_drafts_device(hist, num, 1, 8, k)
    rng = np.random.default_rng(0)
    for _ in range(10):
        tokens = rng.integers(0, 4, (n, width)).astype(np.int64)
        lens = rng.integers(1, width + 1, n).astype(np.int64)
        hist.copy_(torch.from_numpy(tokens))
        num.copy_(torch.from_numpy(lens))
        graph.replay()
        rows = np.arange(n, dtype=np.int64)
        assert np.array_equal(drafts.cpu().numpy(), ngram_drafts(tokens, rows, lens, 1, 8, k))
        assert np.array_equal(match.cpu().numpy(), ngram_match(tokens, rows, lens, 1, 8, k)[1])
