"""``DraftCost``: a draft token's cost measured from the time between a proposer's calls, per
batch-size bucket, and the acceptance probability a draft needs to pay for it."""

from __future__ import annotations

import pytest

from pagoda.spec_decode import DraftCost
from pagoda.spec_decode.cost import DEFAULT_THRESHOLD


def _measured(per_draft: float, n: int = 1, gained: float = 1.0) -> DraftCost:
    clock = [0.0]
    cost = DraftCost(lambda: clock[0])
    given = 0
    for i in range(40):
        clock[0] += 0.1 + per_draft * given  # the step that verified the last call's drafts
        given = i % 9
        cost.step(n, given, gained)
    return cost


def test_the_threshold_is_a_draft_tokens_seconds_over_a_steps_seconds_per_token() -> None:
    assert _measured(0.01).threshold(1) == pytest.approx(0.1)
    # Emitting 2 tokens a step, a token costs half as long: a draft must be twice as likely.
    assert _measured(0.01, gained=2.0).threshold(1) == pytest.approx(0.2, rel=0.1)  # (decayed)
    assert _measured(0.0).threshold(1) == pytest.approx(0.05)  # the floor
    assert _measured(1.0).threshold(1) == pytest.approx(0.9)  # the ceiling


def test_each_batch_size_bucket_measures_its_own_and_starts_at_the_default() -> None:
    cost = _measured(0.01, n=1)
    assert cost.threshold(2) == DEFAULT_THRESHOLD  # nothing measured at 2-3 requests
    assert DraftCost().threshold(1) == DEFAULT_THRESHOLD
