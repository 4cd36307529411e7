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


def test_a_step_far_slower_than_its_drafts_explain_is_left_out() -> None:
    """A kernel compiled for a new verification length (a second, say) at a step of 8 drafts:
    charged to them, every draft token would look dear for a hundred steps."""
    clock = [0.0]
    cost = DraftCost(lambda: clock[0])
    given = 0
    for i in range(60):
        clock[0] += 0.1 + 0.001 * given + (1.0 if i == 36 else 0.0)  # (8 drafts)
        given = i % 9
        cost.step(1, given, 1.0)
    assert cost.threshold(1) == pytest.approx(0.05)  # as measured without the slow step
    assert _measured(0.001).threshold(1) == pytest.approx(0.05)


def test_steps_that_stay_slower_move_the_fit() -> None:
    clock = [0.0]
    cost = DraftCost(lambda: clock[0])
    given = 0
    for i in range(80):
        # Draft tokens cost nothing, then from step 40 a step costs 0.5 s and 0.05 s a draft.
        clock[0] += 0.1 + 0.0 * given if i < 40 else 0.5 + 0.05 * given
        given = i % 9
        cost.step(1, given, 1.0)
    assert cost.threshold(1) == pytest.approx(0.1, rel=0.05)  # 0.05 s over 0.5 s a token


def test_the_first_step_of_each_draft_count_is_left_out() -> None:
    """What runs for the first time at a new verification length (a oneDNN primitive for its
    rows on a CPU, a kernel compiled for it) costs that step alone: 2.5 times a step here, less
    than an outlier. Drafts of one token mostly, and longer ones now and then, each length new
    when it comes: charged to them, those first times make a draft token look dear."""
    clock = [0.0]
    cost = DraftCost(lambda: clock[0])
    counts = [1] * 10 + [c for n in range(3, 9) for c in (n, 1, 1, 1)] + [1] * 6 + [8, 1, 8, 1]
    given, seen = 0, set()
    for nxt in counts:
        clock[0] += 0.1 + 0.001 * given + (0.15 if given not in seen else 0.0)
        seen.add(given)
        given = nxt
        cost.step(1, given, 1.0)
    assert cost.threshold(1) == pytest.approx(0.05)  # 1 ms a draft over 100 ms a token


def test_at_several_requests_every_draft_total_counts() -> None:
    """At 4 requests a step's drafts are a sum over them that seldom repeats: leaving out each
    first total would leave nothing to fit."""
    clock = [0.0]
    cost = DraftCost(lambda: clock[0])
    given = 0
    for i in range(40):
        clock[0] += 0.1 + 0.01 * given
        given = 7 * i % 40  # (40 totals, each once)
        cost.step(4, given, 1.0)
    # 0.01 s a draft over 0.1 s a step of 4 tokens
    assert cost.threshold(4) == pytest.approx(0.4)
