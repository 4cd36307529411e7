"""The fixed-shape draft (catch-up and chain in one computation, replayed as a CUDA graph on a
GPU) drafts what the eager draft through the attention backend drafts: same cache, same
tokens, on decoding steps of a batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from eagle_helpers import tiny_target, write_random_head
from pagoda_spec_eagle.proposer import Eagle3Proposer, EagleProposer

from pagoda.config import SpeculativeConfig
from pagoda.spec_decode import ProposalBatch
from pagoda.testing.spec_decode import make_context


def _batch(histories: list[list[int]], rows: list[int], m: list[int], width: int, k: int):
    token_ids = np.full((10, 300), -1, dtype=np.int64)
    for r, h in zip(rows, histories):
        token_ids[r, : len(h)] = h
    gen = torch.Generator().manual_seed(sum(m))
    loc = np.zeros(len(m) + 1, dtype=np.int64)
    np.cumsum(m, out=loc[1:])
    return ProposalBatch(
        req_ids=[f"r{r}" for r in rows],
        rows=np.asarray(rows, dtype=np.int64),
        token_ids=token_ids,
        num_tokens=np.asarray([len(h) for h in histories], dtype=np.int64),
        num_prompt_tokens=np.asarray([len(h) // 2 for h in histories], dtype=np.int64),
        max_num_drafts=np.full(len(rows), k, dtype=np.int64),
        new_hidden_states=torch.randn(int(loc[-1]), width, generator=gen),
        hidden_loc=loc,
    )


def _fast_and_eager(path: Path, kind: str, cls: type, k: int) -> tuple:
    """Two proposers of one random head on one tiny target: the first drafts in the fixed
    shape, the second eagerly."""
    head = write_random_head(path, kind, 64, 512, draft_vocab=256, std=0.5)
    cfg = SpeculativeConfig(method=kind, model=str(head), num_speculative_tokens=k)
    proposers = []
    for _ in range(2):
        ctx = make_context(cfg)
        p = cls(ctx)
        p.bind_target(tiny_target(ctx))
        proposers.append(p)
    fast, eager = proposers
    assert fast.chain is not None
    eager.chain = None
    return fast, eager


def test_fixed_shape_draft_matches_the_eager_draft(tmp_path: Path) -> None:
    k = 3
    for kind, cls in (("eagle3", Eagle3Proposer), ("eagle", EagleProposer)):
        fast, eager = _fast_and_eager(tmp_path / kind, kind, cls, k)
        width = 64 * max(1, len(fast.hidden_state_layers))
        rng = np.random.default_rng(0)
        hist = [rng.integers(0, 512, n).tolist() for n in (40, 17, 90)]
        rows = [4, 0, 7]
        # A prompt each (on the fast one: its older rows eagerly, the last k + 1 and the draft
        # in the fixed shape), then decoding steps of 1 to k + 1 new rows.
        first = _batch(hist, rows, [len(h) - 1 for h in hist], width, k)
        assert np.array_equal(fast.propose(first).token_ids, eager.propose(first).token_ids)
        # (Two steps: random drafts miss, and a third miss in a row would pause the requests.)
        for step, m in enumerate(([1, 2, 3], [4, 1, 2])):
            hist = [h + rng.integers(0, 512, n).tolist() for h, n in zip(hist, m)]
            batch = _batch(hist, rows, m, width, k)
            got, want = fast.propose(batch).token_ids, eager.propose(batch).token_ids
            assert np.array_equal(got, want), (kind, step, got, want)
        assert fast.chain.runs == 3 and (eager.chain is None)


def test_a_catch_up_longer_than_the_chain_drafts_as_the_eager_draft(tmp_path: Path) -> None:
    """After a pause a request catches up on more rows than the fixed shape holds: the older
    ones are written eagerly, the rest drafts in the fixed shape, and the drafts are the eager
    path's, for requests with short and long catch-ups in one batch."""
    k = 3
    fast, eager = _fast_and_eager(tmp_path / "h", "eagle3", Eagle3Proposer, k)
    width = 64 * len(fast.hidden_state_layers)
    rng = np.random.default_rng(1)
    hist = [rng.integers(0, 512, n).tolist() for n in (30, 12, 55)]
    rows = [2, 5, 1]
    first = _batch(hist, rows, [len(h) - 1 for h in hist], width, k)
    assert np.array_equal(fast.propose(first).token_ids, eager.propose(first).token_ids)
    m = [9, 1, 14]  # more than k + 1 = 4 rows for two of the three
    hist = [h + rng.integers(0, 512, n).tolist() for h, n in zip(hist, m)]
    batch = _batch(hist, rows, m, width, k)
    got, want = fast.propose(batch).token_ids, eager.propose(batch).token_ids
    assert np.array_equal(got, want), (got, want)
    assert (got >= 0).all()  # every request drafted k tokens
    assert fast.chain.runs == 2
