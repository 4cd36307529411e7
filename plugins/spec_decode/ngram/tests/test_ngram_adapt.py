"""The n-gram proposer at its defaults: draft lengths follow the acceptance it measures and the
cost of a draft token it measures; the keys a user gives fix their part."""

from __future__ import annotations

import numpy as np
import pytest
from pagoda_spec_ngram.adapt import DraftLengths
from pagoda_spec_ngram.proposer import NgramProposer

from pagoda.config import SpeculativeConfig
from pagoda.spec_decode import ProposalBatch
from pagoda.testing.spec_decode import make_context


def _batch(histories: list[list[int]]) -> ProposalBatch:
    ids = np.full((10, 400), -1, dtype=np.int64)
    for r, h in enumerate(histories):
        ids[r, : len(h)] = h
    n = len(histories)
    return ProposalBatch(
        req_ids=[f"r{i}" for i in range(n)],
        rows=np.arange(n, dtype=np.int64),
        token_ids=ids,
        num_tokens=np.array([len(h) for h in histories], dtype=np.int64),
        num_prompt_tokens=np.ones(n, dtype=np.int64),
        max_num_drafts=np.full(n, 8, dtype=np.int64),
    )


def _run(proposer: NgramProposer, texts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy verification simulated: each step, each request's drafts are compared with its
    text's next tokens and the agreeing ones plus one more are appended; a step takes 0.1 s
    and 0.002 s more a draft token (a clock of its own). Returns the draft counts of each
    step."""
    known = [60] * len(texts)
    counts = []
    clock = [0.0]
    proposer.adapt.cost.clock = lambda: clock[0]
    for _ in range(steps):
        clock[0] += 0.1 + 0.002 * sum(counts[-1]) if counts else 0.1
        batch = _batch([t[:n] for t, n in zip(texts, known)])
        drafts = proposer.propose(batch)
        got = drafts.counts(512, batch.max_num_drafts)
        counts.append(got.tolist())
        for i, (t, n) in enumerate(zip(texts, known)):
            d = drafts.token_ids[i, : got[i]]
            agree = d == np.asarray(t[n : n + len(d)])
            known[i] = n + (len(d) if agree.all() else int(agree.argmin())) + 1
    return counts


def test_accepted_requests_draft_long_and_refused_ones_almost_stop() -> None:
    rng = np.random.default_rng(0)
    phrase = rng.integers(0, 500, 30).tolist()
    text = phrase * 12
    # Random tokens of a small alphabet: short matches everywhere, their continuations right
    # one time in 20.
    wrong = rng.integers(0, 20, 200).tolist()
    p = NgramProposer(make_context(SpeculativeConfig(method="ngram")))
    counts = _run(p, [text, wrong], 20)
    assert counts[-1][0] == 8  # the repeating text drafts the most it may
    # The other drafts (almost) nothing once its drafts were measured wrong.
    assert max(c[1] for c in counts[-5:]) <= 1, counts


def test_a_costly_draft_token_shortens_drafts() -> None:
    rows, caps = np.arange(1), np.full(1, 8)
    match = np.full(1, 3)
    cheap, dear = DraftLengths(8, 8, 4), DraftLengths(8, 8, 4)
    for lengths, per_draft in ((cheap, 0.001), (dear, 0.05)):
        lengths.g_hits[:] = lengths.first_hits[:] = 80  # accepted 0.8 at every position
        lengths.g_trials[:] = lengths.first_trials[:] = 100
        clock = [0.0]
        lengths.cost.clock = lambda clock=clock: clock[0]
        d = 0
        for i in range(40):
            clock[0] += 0.1 + per_draft * d  # the step that verified the last call's drafts
            d = i % 9  # drafts given vary, so the cost's regression is defined
            drafts = np.full((1, 8), -1, dtype=np.int64)
            drafts[0, :d] = 1
            lengths.gave(rows, drafts, match, np.array([100 + i]))
        got = lengths.lengths(rows, match, caps)[0]
        if lengths is cheap:
            assert got == 8, got
        else:  # 0.05 s a draft against 0.1 s a token: only p >= 0.5 pays (0.8, 0.64, 0.51)
            assert got == 3, got


def test_given_keys_fix_the_draft_length_and_the_window() -> None:
    cfg = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2
    )
    p = NgramProposer(make_context(cfg))
    assert p.adapt is None and (p.min_n, p.max_n) == (2, 2)
    wrong = np.random.default_rng(1).integers(0, 20, 200).tolist()
    batch = _batch([wrong[:150]])
    for _ in range(20):  # whatever it would measure, every match drafts 3
        assert p.propose(batch).counts(512, batch.max_num_drafts)[0] in (0, 3)


@pytest.mark.parametrize("seed", range(4))
def test_small_batches_scored_a_request_at_a_time_match_the_batch_pass(seed, monkeypatch) -> None:
    """Batches of up to ``_ROW_MAX_BATCH`` requests are scored and given lengths a request at
    a time; larger ones by the vectorised passes. Two instances fed the same steps (and one
    clock), one forced onto the vectorised passes, keep the same counts bit for bit and choose
    the same lengths: drafts cut short, rejected at any position, accepted whole, not scored (no
    token came since), and histories past the token array's last column."""
    from pagoda_spec_ngram import adapt as a

    rng = np.random.default_rng(seed)
    k, max_match, num_rows, width = 6, 5, 6, 40
    now = [0.0]
    rows_path = DraftLengths(k, max_match, num_rows, clock=lambda: now[0])
    batch_path = DraftLengths(k, max_match, num_rows, clock=lambda: now[0])
    for _ in range(300):
        now[0] += float(rng.uniform(0.01, 0.02))
        n = int(rng.integers(1, a._ROW_MAX_BATCH + 1))
        rows = rng.choice(num_rows, n, replace=False).astype(np.int64)
        ids = rng.integers(0, 3, (num_rows, width)).astype(np.int64)
        num = rng.integers(1, width + 3, n).astype(np.int64)  # past the end: the last column
        match = rng.integers(0, max_match + 3, n).astype(np.int64)
        caps = rng.integers(0, k + 1, n).astype(np.int64)
        drafts = rng.integers(0, 3, (n, k)).astype(np.int64)
        drafts[np.arange(k)[None, :] >= rng.integers(0, k + 1, n)[:, None]] = -1
        req_ids = [f"q{r}" for r in rows.tolist()]
        seen = []
        for obj, vectorised in ((rows_path, False), (batch_path, True)):
            if vectorised:
                monkeypatch.setattr(a, "_ROW_MAX_BATCH", 0)
            obj.own(req_ids, rows)
            obj.observe(rows, ids, num)
            seen.append((obj._gained, obj.lengths(rows, match, caps).tolist()))
            obj.gave(rows, drafts, match, num)
            monkeypatch.undo()
        assert seen[0] == seen[1]
        for name in ("hits", "trials", "g_hits", "g_trials", "first_hits", "first_trials", "given"):
            assert np.array_equal(getattr(rows_path, name), getattr(batch_path, name)), name


def test_the_time_between_requests_is_not_a_step() -> None:
    """Requests one after another in one row (batch 1): between one's last call, which gave
    drafts, and the next one's first, the engine ran the next one's prefill (or sat idle, or
    ran another engine). Timed as a step of the last drafts, that gap made them look dear."""
    rng = np.random.default_rng(0)
    text = rng.integers(0, 500, 30).tolist() * 12

    def measured(gap: float) -> DraftLengths:
        p = NgramProposer(make_context(SpeculativeConfig(method="ngram")))
        clock = [0.0]
        p.adapt.cost.clock = lambda: clock[0]
        given = 0
        for r in range(8):
            clock[0] += gap
            for step in range(16):
                clock[0] += 0.1 + 0.001 * given
                batch = _batch([text[: 60 + 7 * step]])
                batch.req_ids = [f"req{r}"]
                batch.max_num_drafts[:] = 1 + step % 8  # (counts that vary, 8 at the last)
                given = int(p.propose(batch).counts(512, batch.max_num_drafts)[0])
                p.settle()  # (as the runner does once the step is launched)
        assert given == 8  # (each request's last call gave 8 drafts)
        return p.adapt

    apart, back_to_back = measured(0.15), measured(0.0)
    assert back_to_back.cost.fits[1].fit() is not None
    assert apart.cost.threshold(1) == pytest.approx(back_to_back.cost.threshold(1), rel=1e-9)
