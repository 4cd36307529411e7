"""A proposer that paces itself (drafts only what it measured to pay) drafts at batch 1 without
the speculation governor's epochs; from 2 running requests on the governor measures as before."""

from __future__ import annotations

import pytest

from pagoda.config import SpeculativeConfig
from pagoda.scheduler.spec_governor import build_governor
from pagoda.spec_decode.proposer import proposer_paces_itself


def test_a_self_paced_governor_drafts_at_batch_1_unmeasured_and_measures_from_2() -> None:
    now = [0.0]
    gov = build_governor(SpeculativeConfig(method="ngram"), self_paced=True)
    gov.clock = lambda: now[0]
    for _ in range(200):  # drafting that loses: plain steps twice as fast per token
        assert gov.drafting(1)
        now[0] += 1.0
        gov.observe(1, 1, accepted=0)
    assert gov.epochs == {True: 0, False: 0}  # batch 1 never ran an epoch
    for _ in range(200):
        on = gov.drafting(2)
        now[0] += 2.0 if on else 1.0
        gov.observe(2, 2, accepted=0)
    assert gov.epochs[False] > gov.epochs[True] > 0  # measured, and drafting lost


@pytest.mark.parametrize(
    "method,keys,paces",
    [
        ("ngram", {}, True),
        ("ngram", {"prompt_lookup_min": 2}, True),  # the window given, lengths still chosen
        ("ngram", {"num_speculative_tokens": 4}, False),  # a fixed length: the governor decides
        ("suffix", {}, True),
    ],
)
def test_history_proposers_pace_themselves_while_they_choose_lengths(method, keys, paces) -> None:
    pytest.importorskip(f"pagoda_spec_{method}")
    assert proposer_paces_itself(SpeculativeConfig(method=method, **keys)) is paces


def test_eagle_does_not_pace_itself() -> None:
    pytest.importorskip("pagoda_spec_eagle")
    assert not proposer_paces_itself(SpeculativeConfig(method="eagle3"))
