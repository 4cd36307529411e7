"""The greedy verification kernel equals the rejection sampler's torch path, token for token.

On a machine without CUDA the kernel runs in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is defined

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(find_spec("triton") is None, reason="needs triton"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("k", [1, 3, 4, 7])
@pytest.mark.parametrize("seed", range(4))
def test_kernel_matches_the_torch_rejection_sampler(k: int, seed: int) -> None:
    from pagoda.sample.greedy_verify_kernel import greedy_verify
    from pagoda.sample.rejection import rejection_sample

    gen = torch.Generator().manual_seed(seed)
    n = 6
    nd = torch.randint(0, k + 1, (n,), generator=gen)
    nd[0] = k  # a request with every draft
    nd[1] = 0  # one with none
    width = nd + 1
    starts = torch.zeros(n, dtype=torch.int64)
    starts[1:] = torch.cumsum(width, 0)[:-1]
    total = int(width.sum())
    vocab = 5  # few ids: many drafts match by chance, so every accepted length occurs
    argmax = torch.randint(0, vocab, (total,), generator=gen)
    drafts = torch.randint(0, vocab, (n, k), generator=gen)
    # Request 0 matches all its drafts; past each request's drafts the ids are -1.
    drafts[0] = argmax[starts[0] : starts[0] + k]
    drafts[torch.arange(k).unsqueeze(0) >= nd.unsqueeze(1)] = -1
    args = [t.to(DEVICE) for t in (argmax, drafts, nd, starts)]
    got_tokens, got_emitted = greedy_verify(*args)
    argmax_d, drafts_d, nd_d, starts_d = args
    want_tokens, want_emitted = rejection_sample(
        argmax_d, None, drafts_d, nd_d, starts_d, kernel=False
    )
    assert torch.equal(got_tokens.cpu(), want_tokens.cpu())
    assert torch.equal(got_emitted.cpu(), want_emitted.cpu())
    assert int(got_emitted[0]) == k + 1 and int(got_emitted[1]) == 1
    # The sampler takes the kernel on CUDA and its torch path elsewhere: the same tokens.
    tokens, emitted = rejection_sample(argmax_d, None, drafts_d, nd_d, starts_d)
    assert torch.equal(tokens, got_tokens) and torch.equal(emitted, got_emitted)
