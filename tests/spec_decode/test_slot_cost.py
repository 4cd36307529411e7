"""``pagoda.worker.slot_cost.SlotCost`` (what a step with draft slots costs beyond one without,
from the times between launches of decode steps that waited for the step in flight and found no
draft, and of those that did not wait) and ``DraftPause`` weighing a request's accepted drafts
against it: a request whose slot steps bring fewer accepted tokens than they cost pauses, one
whose drafts are accepted does not, and an accepted probe ends the pause."""

from __future__ import annotations

import numpy as np

from pagoda.spec_decode import DraftPause
from pagoda.worker.slot_cost import SlotCost


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _launches(meter: SlotCost, clock: _Clock, kinds: list[tuple[bool, float]], n: int = 1):
    for waited, seconds in kinds:
        meter.launched(n, waited)
        clock.t += seconds


def test_the_cost_is_the_slot_steps_time_over_the_plain_ones_once_each_has_enough() -> None:
    clock = _Clock()
    meter = SlotCost(clock)
    _launches(meter, clock, [(True, 0.0035), (False, 0.0017)] * 7)
    assert meter.cost(1) is None  # 7 of each: not yet
    _launches(meter, clock, [(True, 0.0035), (False, 0.0017)] * 2)
    assert abs(meter.cost(1) - (0.0035 / 0.0017 - 1)) < 1e-9
    assert meter.cost(2) is None and meter.cost(64) is None  # other batch sizes: unmeasured
    got = meter.summary(1)  # (what a benchmark's report shows)
    assert (got["waited_ms"], got["plain_ms"]) == (3.5, 1.7)
    assert got["waited_steps"] + got["plain_steps"] == 17  # (the last launch is not timed yet)
    assert got["cost"] == meter.cost(1)
    assert meter.summary(64) == {
        "waited_ms": None, "waited_steps": 0, "plain_ms": None, "plain_steps": 0, "cost": None
    }  # fmt: skip


def test_gaps_and_steps_with_drafts_or_a_prompt_are_not_timed() -> None:
    clock = _Clock()
    meter = SlotCost(clock)
    _launches(meter, clock, [(True, 0.003), (False, 0.002)] * 10)
    _launches(meter, clock, [(True, 0.25)])  # a gap between requests after a slot step
    _launches(meter, clock, [(None, 0.05)])  # a step with drafts (or a prompt)
    _launches(meter, clock, [(True, 0.003), (False, 0.002)])
    assert abs(meter.cost(1) - 0.5) < 1e-9
    meter.launched(1, True, at=clock.t)  # (the launch's own time, given)
    meter.launched(1, None, at=clock.t + 0.0045)
    assert meter.cost(1) > 0.5  # a slot step of 4.5 ms counted


def test_a_first_time_cost_among_the_first_steps_does_not_set_the_mean() -> None:
    # The first slot step met a kernel's compile (40 ms); the others took 1.5 ms, as plain
    # steps do: the slots cost nothing, from the first measure on.
    clock = _Clock()
    meter = SlotCost(clock)
    _launches(meter, clock, [(True, 0.040), (False, 0.0015)])
    _launches(meter, clock, [(True, 0.0015), (False, 0.0015)] * 8)
    assert meter.cost(1) is not None and abs(meter.cost(1)) < 1e-9
    # (later steps move the mean as before: slot steps of 3 ms raise the cost)
    _launches(meter, clock, [(True, 0.003), (False, 0.0015)] * 20)
    assert meter.cost(1) > 0.5


def test_the_proposers_bookkeeping_between_launches_is_not_counted() -> None:
    # Slot steps of 1.5 ms of which 0.5 is the proposer's settle (it follows the calls, which
    # come only in slot steps), plain steps of 1.0: the slots cost nothing beyond that.
    clock = _Clock()
    meter = SlotCost(clock)
    for _ in range(10):
        meter.launched(1, True)
        clock.t += 0.001
        meter.exclude(0.0005)
        clock.t += 0.0005
        meter.launched(1, False)
        clock.t += 0.001
    assert abs(meter.cost(1)) < 1e-9
    got = meter.summary(1)
    assert (got["waited_ms"], got["plain_ms"]) == (1.0, 1.0)
    meter.exclude(0.0002)  # (left out of the step it was spent in, and of that one only)
    clock.t += 0.0002
    meter.launched(1, True)
    clock.t += 0.002
    meter.launched(1, True)
    assert meter.summary(1)["waited_ms"] > 1.0


def test_a_request_whose_slot_steps_do_not_pay_pauses_and_an_accepted_probe_ends_it() -> None:
    resume: dict[str, int] = {}
    pause = DraftPause(resume)
    ids = ["copy", "chat"]
    found = np.array([True, True])
    # Both draft every step; "copy" gains 4 tokens a step (3 accepted), "chat" 1 (none).
    pause.update(ids, np.array([100, 100]), found, slot_cost=0.6)
    pause.update(ids, np.array([104, 101]), found, slot_cost=0.6)
    assert pause.accepted == {"copy": 3.0, "chat": 0.0}
    assert resume == {"chat": 103}  # asked again once it knows 103 tokens: 1 step skipped
    # Steps ran without "chat" (paused): its next call's gain is not a slot step's.
    pause.update(ids, np.array([108, 103]), found, slot_cost=0.6)
    assert pause.accepted["chat"] == 0.0 and resume == {}
    pause.update(["chat"], np.array([104]), np.array([True]), slot_cost=0.6)  # none accepted
    assert resume == {"chat": 107}  # 2 steps skipped now
    pause.update(["chat"], np.array([107]), np.array([True]), slot_cost=0.6)
    pause.update(["chat"], np.array([111]), np.array([True]), slot_cost=0.6)  # 3 accepted
    assert pause.accepted["chat"] == 1.5 and "chat" not in resume  # over the cost: no pause


def test_without_a_measured_cost_only_misses_pause() -> None:
    resume: dict[str, int] = {}
    pause = DraftPause(resume)
    for n in range(100, 110):
        pause.update(["a"], np.array([n]), np.array([True]))  # nothing accepted, no cost
    assert resume == {} and pause.accepted["a"] == 0.0


def test_the_engine_measures_the_cost_and_hands_it_to_the_proposer(monkeypatch) -> None:
    # Random weights, greedy, at batch 1: the n-gram proposer's misses pause the request, so
    # both kinds of step run (with slots and, paused, without); once each has its samples, the
    # proposer's calls carry the cost the runner measured.
    import torch
    from test_verify_graph_layout import TINY

    from pagoda import LLM, SamplingParams
    from pagoda.bench.random_weights import ensure_random_weights

    folder, _ = ensure_random_weights(TINY, 0, torch.device("cpu"))
    llm = LLM(
        model=str(folder),
        device="cpu",
        max_model_len=512,
        max_num_seqs=1,
        speculative_config={"method": "ngram"},
    )
    spec = llm.engine.engine_core.executor.worker.model_runner.spec
    given: list[float | None] = []
    update = DraftPause.update

    def spy(self, req_ids, num_tokens, found, slot_cost=None) -> None:
        given.append(slot_cost)
        update(self, req_ids, num_tokens, found, slot_cost)

    monkeypatch.setattr(DraftPause, "update", spy)
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(20, 60))}], params, use_tqdm=False)
    assert spec.slot_cost.cost(1) is not None
    assert given and given[0] is None  # (nothing measured at the start)
    assert any(c is not None for c in given)
