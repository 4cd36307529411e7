"""The speculation governor turns drafting off for a batch size where it does not pay and keeps it
on where it does, from tokens per second it measures (a fake clock here, so every run is the
same); it follows a workload that changes, ignores prompt steps and idle gaps, and honours vLLM's
``disable_by_batch_size``. In an engine, drafting turned off changes no token."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.config import SpeculativeConfig
from pagoda.scheduler import draft_policy
from pagoda.scheduler.spec_governor import SpeculationGovernor, build_governor, is_decode_step

TINY = Path(__file__).parents[2] / "benchmarks" / "configs" / "tiny-llama"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# A step's cost (seconds) and tokens emitted per request, by whether it drafted.
Cost = Callable[[bool], tuple[float, float]]


def _run(gov: SpeculationGovernor, clock: FakeClock, steps: int, batch: int, cost: Cost) -> list:
    """``steps`` decode steps of ``batch`` requests; the mode of each. Every request runs in
    every step: tokens beyond one a request are accepted drafts."""
    modes = []
    for _ in range(steps):
        on = gov.drafting(batch)
        seconds, per_request = cost(on)
        clock.now += seconds
        emitted = round(per_request * batch)
        gov.observe(emitted, batch, accepted=max(emitted - batch, 0))
        modes.append(on)
    return modes


def _host_bound(on: bool) -> tuple[float, float]:
    """Batch 64 on a host-bound device: a step with drafts takes longer and, with half the
    batch sitting out, yields fewer tokens per second than a plain one."""
    return (1.2e-3, 1.1) if on else (1.0e-3, 1.0)


def _drafts_pay(on: bool) -> tuple[float, float]:
    """Batch 1 with a good proposer: a verification step costs a little more and emits 3."""
    return (12e-3, 3.0) if on else (10e-3, 1.0)


def test_drafting_turns_off_where_it_does_not_pay_and_probes_ever_less() -> None:
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    modes = _run(gov, clock, 2000, 64, _host_bound)
    # It starts drafting (the user asked for it), measures both modes within a few epochs ...
    assert modes[0] and not all(modes[:40])
    # ... and from then on drafts only in probes, whose interval doubles while they confirm.
    late = modes[500:]
    assert sum(late) / len(late) < 0.05, sum(late)
    assert gov.buckets[gov.bucket_of(64)].explore_every == gov.max_explore
    # Each epoch is on record: bucket, mode, rate a request, median step, steps measured and,
    # drafting, tokens per forward a request ran in; whether it counted.
    first, second = list(gov.history)[:2]
    b = gov.bucket_of(64)
    rate = pytest.approx(70 / 64 / 1.2e-3)
    assert first == (b, True, rate, pytest.approx(1.2e-3), 8, pytest.approx(70 / 64), True)
    assert second == (b, False, pytest.approx(1 / 1e-3), pytest.approx(1e-3), 8, None, True)


def _loses_much(on: bool) -> tuple[float, float]:
    """Batch 64, drafts rarely right: a step with drafts costs twice a plain one."""
    return (2.0e-3, 1.2) if on else (1.0e-3, 1.0)


def test_probes_of_a_mode_that_loses_much_are_spaced_by_their_cost() -> None:
    """Drafting at 60% of plain: each probe of it loses 40% of an epoch and a half (45% with what
    a switch to drafting costs beyond its epoch, ``draft_margin``), so once both modes were
    measured twice the next probe waits some 30 epochs (2% of the time); a near tie is probed
    far sooner."""
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    modes = _run(gov, clock, 450, 64, _loses_much)
    # A drafting epoch (4 settling steps + 8), a plain probe (2 + 8), three plain epochs, a
    # drafting probe that confirms the choice, then 32 plain epochs (the cap, ``max_explore``).
    assert all(modes[:12]) and not any(modes[12:52]) and all(modes[52:64])
    assert not any(modes[64:384]) and any(modes[384:400]), modes.index(True, 64)
    assert gov.buckets[gov.bucket_of(64)].explore_every >= 30
    # Spaced by the fixed interval alone, drafting came back within a few epochs.
    eager = SpeculationGovernor(clock=FakeClock(), probe_budget=1.0)
    assert any(_run(eager, eager.clock, 450, 64, _loses_much)[64:200])
    without = SpeculationGovernor(clock=FakeClock(), draft_margin=0.0)  # 40%: 30 epochs
    assert any(_run(without, without.clock, 450, 64, _loses_much)[360:380])
    near = SpeculationGovernor(clock=FakeClock())
    tie = _run(near, near.clock, 450, 64, lambda on: (1.32e-3, 1.3) if on else (1e-3, 1.0))
    assert any(tie[64:200])


def _split_batch(
    gov: SpeculationGovernor, steps: int, per_request: bool, sit_out: bool = True
) -> list[bool]:
    """Batch 64 where drafting speeds half the requests up and slows the others down: in a
    drafting step (1.5 ms against a plain step's 1 ms) each of 32 requests that copy emits 6
    tokens, and each of the other 32, whose drafts are rejected, emits one token every other
    step (it sits the next step out while its verification is in flight). The batch's mean
    rate is twice plain's; its slower half runs at a third (``sit_out`` False: one token every
    step, two thirds). ``per_request``: the governor is told each request's tokens, as the
    scheduler tells it."""
    clock, modes = gov.clock, []
    ids = [f"r{i}" for i in range(64)]
    for step in range(steps):
        on = gov.drafting(64)
        clock.now += 1.5e-3 if on else 1e-3
        if on:
            counts = {
                r: 6 if i < 32 else (i + step) % 2 if sit_out else 1 for i, r in enumerate(ids)
            }
        else:
            counts = dict.fromkeys(ids, 1)
        emitted = sum(counts.values())
        accepted = 5 * 32 if on else 0
        gov.observe(emitted, 64, accepted=accepted, by_request=counts if per_request else None)
        modes.append(on)
    return modes


def test_drafting_that_slows_some_requests_down_does_not_win_on_the_mean() -> None:
    """The governor does not make a request more than ``slowdown`` slower than plain steps
    would: drafting whose mean rate is twice plain's, but whose slower requests run at a third
    of it, is turned off and probed ever less; told only the batch's totals it drafts on."""
    gov = SpeculationGovernor(clock=FakeClock())
    late = _split_batch(gov, 2000, per_request=True)[500:]
    assert sum(late) / len(late) < 0.05, sum(late)
    bucket = gov.buckets[gov.bucket_of(64)]
    assert bucket.floor == pytest.approx(0.5 / 1.5e-3, rel=0.05)
    assert bucket.rate[True] > 1.5 * bucket.rate[False]  # the mean alone would choose drafting
    blind = SpeculationGovernor(clock=FakeClock())
    late = _split_batch(blind, 2000, per_request=False)[500:]
    assert sum(late) / len(late) > 0.9


def _runs_of_drafting(modes: list[bool]) -> list[int]:
    runs, n = [], 0
    for on in modes + [False]:
        if on:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_a_probe_whose_slower_requests_clearly_lose_ends_early() -> None:
    """Once plain steps were measured, a drafting probe whose slower requests run below
    ``cut_early`` (half) of plain's rate ends after 4 settling and 2 measured steps; one whose
    slower requests run below ``cut_short`` (three quarters) after 4 and 4, not 8; the first
    epoch (nothing to compare with) runs whole. Without the cuts every probe runs 12."""
    gov = SpeculationGovernor(clock=FakeClock())
    runs = _runs_of_drafting(_split_batch(gov, 2000, per_request=True))  # a third of plain's
    assert runs[0] == 12 and len(runs) > 2 and set(runs[1:]) == {6}, runs
    near = SpeculationGovernor(clock=FakeClock())  # two thirds: judged at half
    runs = _runs_of_drafting(_split_batch(near, 2000, per_request=True, sit_out=False))
    assert runs[0] == 12 and len(runs) > 2 and set(runs[1:]) == {8}, runs
    late = SpeculationGovernor(clock=FakeClock(), cut_early=0.0)
    assert set(_runs_of_drafting(_split_batch(late, 2000, per_request=True))[1:]) == {8}
    whole = SpeculationGovernor(clock=FakeClock(), cut_short=0.0, cut_early=0.0)
    assert set(_runs_of_drafting(_split_batch(whole, 2000, per_request=True))) == {12}


def test_where_steps_alternate_a_bucket_starts_plain_and_a_clear_loss_holds() -> None:
    """From ``plain_first_from`` running requests a bucket's first epoch is plain (2 settling
    steps and 8 measured); drafting is probed right after and, its slower requests clearly
    losing, cut short (4 + 2 steps). That loss counts as confirmed: no probe for the next 32
    epochs (the cap of probes spaced by their cost), and a batch that turns over (a new batch
    of 64 admitted) is not probed at its first turnover. Without the start and the cut, the
    first 12 steps draft and drafting is probed again within a few epochs."""
    gov = SpeculationGovernor(clock=FakeClock(), plain_first_from=8)
    gov.admit(64)
    modes = _split_batch(gov, 100, per_request=True)
    gov.admit(64)  # the next batch
    modes += _split_batch(gov, 230, per_request=True)
    assert not any(modes[:10]) and all(modes[10:16]) and not any(modes[16:]), modes.index(True, 16)
    old = SpeculationGovernor(clock=FakeClock(), cut_short=0.0, cut_early=0.0)
    old.admit(64)
    before = _split_batch(old, 100, per_request=True)
    assert all(before[:12]) and any(before[22:100])


def test_one_slow_epoch_does_not_hold_a_wrong_choice() -> None:
    """The first plain probe runs while the host is busy elsewhere (every step three times
    slower): drafting, which loses, is kept, but plain is probed again within a few epochs
    and wins; the slow epoch did not space the probes out."""
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    steps = {"n": 0}

    def busy_early(on: bool) -> tuple[float, float]:
        steps["n"] += 1
        seconds, tokens = _loses_much(on)
        return (seconds * 3 if 12 < steps["n"] <= 22 else seconds), tokens

    modes = _run(gov, clock, 400, 64, busy_early)
    assert all(modes[:12]) and not any(modes[12:22]) and all(modes[22:34])  # drafting kept
    assert not any(modes[200:]), modes.index(True, 200)


def test_drafting_stays_on_where_it_pays() -> None:
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    modes = _run(gov, clock, 2000, 1, _drafts_pay)
    assert sum(modes) / len(modes) > 0.9
    assert sum(modes[500:]) / len(modes[500:]) > 0.95
    assert not all(modes)  # the plain mode is probed, so a change would be seen


def test_each_batch_size_bucket_decides_for_itself() -> None:
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    for _ in range(20):  # batch sizes alternate in spells longer than an epoch
        _run(gov, clock, 50, 64, _host_bound)
        _run(gov, clock, 50, 1, _drafts_pay)
    assert not gov.drafting(64)
    assert gov.drafting(1)
    assert gov.bucket_of(64) == gov.bucket_of(127) != gov.bucket_of(63)


def test_a_workload_that_starts_to_pay_turns_drafting_back_on() -> None:
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    before = _run(gov, clock, 1000, 8, _host_bound)
    assert sum(before[500:]) < 0.05 * 500
    modes = _run(gov, clock, 1000, 8, _drafts_pay)
    # Plain steps measure slower at once, below drafting's last rate: within a few epochs it
    # drafts again, and from then on mostly drafts.
    assert sum(modes[:120]) > 0.6 * 120
    assert sum(modes[500:]) / len(modes[500:]) > 0.95


def test_a_batch_draining_from_where_drafting_lost_does_not_draft_by_default() -> None:
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    assert gov.drafting(40)  # the ramp-up passes through a smaller bucket, unmeasured
    gov.observe(40, 40, clean=False)
    _run(gov, clock, 300, 64, _host_bound)
    assert not gov.buckets[gov.bucket_of(64)].best  # drafting lost at 64
    # The batch drains: its last requests run plain, probing drafting only after a few epochs.
    tail = _run(gov, clock, 30, 40, _host_bound) + _run(gov, clock, 30, 20, _host_bound)
    assert not any(tail[:24]) and not any(tail[30:54]), tail
    # Where drafting pays, a drained bucket still finds it.
    assert sum(_run(gov, clock, 600, 2, _drafts_pay)[300:]) > 0.9 * 300
    # Without a larger bucket's measurement, an unmeasured bucket drafts from its first step.
    fresh = SpeculationGovernor(clock=FakeClock())
    assert all(_run(fresh, fresh.clock, 12, 40, _host_bound))


def _slowed(cost: Cost, start: int, steps: int, factor: float) -> Cost:
    """``cost`` with steps ``start`` to ``start + steps - 1`` (counting from 0) ``factor`` times
    slower."""
    seen = {"n": 0}

    def slowed(on: bool) -> tuple[float, float]:
        n, seen["n"] = seen["n"], seen["n"] + 1
        seconds, tokens = cost(on)
        return (seconds * factor if start <= n < start + steps else seconds), tokens

    return slowed


def _to_a_plain_epoch(gov: SpeculationGovernor, clock: FakeClock, cost: Cost) -> None:
    """Runs steps of batch 64 until the next one starts an epoch of plain steps."""
    for _ in range(1000):
        if gov.epoch is not None and gov.epoch.steps == 0 and not gov.epoch.on:
            return
        _run(gov, clock, 1, 64, cost)
    raise AssertionError("no plain epoch began")


def test_an_epoch_whose_every_step_slowed_is_measured_again() -> None:
    """Drafting yields 14% less than plain steps; after both modes were measured twice, every step
    of one plain epoch runs four times slower (the host busy elsewhere). Without the check that
    epoch turns drafting on; with it the epoch is left out, measured again, and plain steps
    keep running (drafting only in a probe). Slowed for two epochs in a row, the slowdown
    counts."""

    def cost(on: bool) -> tuple[float, float]:
        return (1.4e-3, 1.2) if on else (1.0e-3, 1.0)

    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    warm = _run(gov, clock, 200, 64, cost)
    b = gov.bucket_of(64)
    assert not any(warm[100:]) and min(gov.buckets[b].epochs.values()) >= 2
    _to_a_plain_epoch(gov, clock, cost)
    epochs = len(gov.history)
    # The epoch's 10 steps (2 settling, 8 measured) run slow.
    after = _run(gov, clock, 200, 64, _slowed(cost, 0, 10, 4.0))
    assert not gov.buckets[b].best and sum(after) <= 12, after  # at most one probe of drafting
    dropped = [e for e in list(gov.history)[epochs:] if not e[6]]
    assert len(dropped) == 1 and not dropped[0][1], dropped
    assert gov.buckets[b].rate[False] == pytest.approx(1 / 1e-3)

    unchecked = SpeculationGovernor(clock=FakeClock(), disturbance=math.inf)
    _run(unchecked, unchecked.clock, 200, 64, cost)
    _to_a_plain_epoch(unchecked, unchecked.clock, cost)
    assert sum(_run(unchecked, unchecked.clock, 200, 64, _slowed(cost, 0, 10, 4.0))) > 24

    # Two slow epochs in a row: the second counts.
    again = SpeculationGovernor(clock=FakeClock())
    _run(again, again.clock, 200, 64, cost)
    _to_a_plain_epoch(again, again.clock, cost)
    _run(again, again.clock, 20, 64, _slowed(cost, 0, 20, 4.0))
    assert [e[6] for e in list(again.history)[-2:]] == [False, True]
    assert again.buckets[b].rate[False] < 0.7 / 1e-3


def test_prompt_steps_and_idle_gaps_are_not_measured() -> None:
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock, settle_steps=0, epoch_steps=2)
    assert gov.drafting(1)
    clock.now += 5.0  # a long prompt step: not clean
    gov.observe(1, 1, clean=False)
    gov.idle()
    clock.now += 100.0  # idle, then the first step's end: no previous end to measure from
    gov.observe(1, 1)
    assert gov.epoch.measured == 0
    clock.now += 0.01
    gov.observe(3, 1)
    clock.now += 0.01
    gov.observe(3, 1)
    assert gov.buckets[1].rate[True] == pytest.approx(300.0)


def test_disable_by_batch_size_alone_is_a_fixed_threshold() -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    gov = build_governor(SpeculativeConfig(**ngram, adaptive=False, disable_by_batch_size=16))
    assert gov.drafting(15) and not gov.drafting(16) and not gov.drafting(100)
    clock = FakeClock()
    gov.clock = clock
    assert all(_run(gov, clock, 500, 4, _host_bound))  # never measured, never turned off
    assert build_governor(SpeculativeConfig(**ngram, adaptive=False)) is None
    measured = build_governor(SpeculativeConfig(**ngram, disable_by_batch_size=16))
    assert not measured.fixed and not measured.drafting(16)
    assert build_governor(SpeculativeConfig(disable_by_batch_size=16)) is None  # no speculation


def test_a_decode_step_is_one_token_a_request_plus_its_drafts() -> None:
    assert is_decode_step(5, 2, {"b": [7, 8, 9]}, 0)
    assert not is_decode_step(5, 2, {}, 0)  # a prompt chunk
    assert not is_decode_step(1, 1, {}, 1)  # a new request


@pytest.mark.parametrize("alternate_from", [1, draft_policy.ALTERNATE_FROM])
def test_governor_switching_keeps_greedy_output_token_identical(
    alternate_from, monkeypatch
) -> None:
    """The governor flips drafting every few steps (short epochs, a clock that makes each mode
    look better in turn), with alternating steps or (4 requests, below 8) draft slots: output
    stays what plain decoding gives, nothing leaks."""
    monkeypatch.setattr(draft_policy, "ALTERNATE_FROM", alternate_from)
    folder, _ = ensure_random_weights(TINY, 0, torch.device("cpu"))
    engine = dict(
        model=str(folder),
        device="cpu",
        max_model_len=256,
        max_num_seqs=4,
        kv_cache_memory_bytes=16 << 20,
    )
    rng = np.random.default_rng(11)
    # Prompts that repeat themselves, so that n-gram drafts are found and accepted.
    prompts = [(rng.integers(10, 500, 8).tolist() * 4)[: int(n)] for n in (20, 31, 26, 12)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want = [o.outputs[0].token_ids for o in LLM(**engine).generate(inputs, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    spec |= {"prompt_lookup_min": 1}
    llm = LLM(**engine, speculative_config=spec, async_scheduling=True)
    core = llm.engine.engine_core
    flips = {"n": 0}

    def clock() -> float:  # each mode's epochs alternate between looking fast and slow
        flips["n"] += 1
        return flips["n"] * (1.0 if flips["n"] % 7 else 9.0)

    gov = SpeculationGovernor(clock=clock, epoch_steps=4, settle_steps=2, min_explore=1)
    gov._futile = lambda bucket: False  # the clock alone decides: epochs that draft nothing too
    core.scheduler.spec_governor = gov
    got = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    assert got == want
    assert gov.epochs[True] >= 2 and gov.epochs[False] >= 2, gov.epochs
    assert core.scheduler.spec_stats_total.num_drafts > 0
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1


def test_drafting_is_measured_again_once_the_batch_has_turned_over() -> None:
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    _run(gov, clock, 3000, 1, _host_bound)  # one workload where drafting loses: off, rarely probed
    bucket = gov.buckets[gov.bucket_of(1)]
    assert bucket.explore_every == gov.max_explore and not bucket.best
    while gov.epoch.on or bucket.since_probe:  # to just after a probe of drafting
        _run(gov, clock, 1, 1, _host_bound)
    quiet = copy.deepcopy(gov)
    gov.admit(1)  # a new request: drafting is probed within two epochs
    assert any(_run(gov, clock, 22, 1, _host_bound))
    # Without the turnover, no probe in those steps (the next one is up to 32 epochs away).
    assert not any(_run(quiet, quiet.clock, 22, 1, _host_bound))  # (its own copy of the clock)


def _ngram_engine(max_num_seqs: int) -> LLM:
    """The tiny random Llama with async scheduling and short n-gram drafts."""
    folder, _ = ensure_random_weights(TINY, 0, torch.device("cpu"))
    return LLM(
        model=str(folder),
        device="cpu",
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        kv_cache_memory_bytes=16 << 20,
        async_scheduling=True,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        },
    )


def test_steps_that_every_request_sits_out_count_toward_drafting_at_batch_1(monkeypatch) -> None:
    """Alternating drafts at batch 1: after a step with drafts the schedule is empty (its one
    request sits out); that is not idleness, so the verification step's tokens are measured."""
    monkeypatch.setattr(draft_policy, "ALTERNATE_FROM", 1)
    llm = _ngram_engine(max_num_seqs=1)
    gov = llm.engine.engine_core.scheduler.spec_governor
    ended = []
    end = gov._end
    gov._end = lambda e: (
        ended.append((e.on, sum(n for _, n, _ in e.samples), e.measured, e.accepted)),
        end(e),
    )
    prompt = list(range(20, 30)) * 6
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert llm.engine.engine_core.scheduler.spec_stats_total.num_accepted_tokens > 0
    drafting = [(tokens, measured, acc) for on, tokens, measured, acc in ended if on]
    assert drafting and any(tokens > measured for tokens, measured, _ in drafting), ended
    # The scheduler tells the governor what verification accepted: a request's tokens beyond
    # one a forward.
    assert any(acc > 0 for _, _, acc in drafting), ended
    assert all(acc == 0 for on, _, _, acc in ended if not on), ended
    assert all(acc < tokens for tokens, _, acc in drafting), ended


def test_the_scheduler_tells_the_governor_each_requests_tokens(monkeypatch) -> None:
    """Four requests whose steps alternate: each step the governor hears every running request's
    tokens, 0 for one that sat the step out, summing to what the step emitted; with drafts
    accepted some request emits several in a step. The engine's governor starts the bucket with
    a plain epoch (steps alternate from there)."""
    monkeypatch.setattr(draft_policy, "ALTERNATE_FROM", 2)
    llm = _ngram_engine(max_num_seqs=4)
    gov = llm.engine.engine_core.scheduler.spec_governor
    assert gov.plain_first_from == 2
    heard = []
    observe = gov.observe

    def spy(num_tokens, num_running, clean=True, accepted=0, by_request=None):
        heard.append((num_tokens, num_running, clean, by_request, gov.epoch and gov.epoch.on))
        observe(num_tokens, num_running, clean, accepted, by_request)

    gov.observe = spy
    rng = np.random.default_rng(5)
    prompts = [(rng.integers(10, 500, 6).tolist() * 5)[: int(n)] for n in (24, 30, 18, 27)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.engine_core.scheduler.spec_stats_total.num_accepted_tokens > 0
    decoding = [h for h in heard if h[2] and h[1] == 4 and h[4]]  # (in drafting epochs)
    assert decoding and all(len(h[3]) == 4 and sum(h[3].values()) == h[0] for h in decoding)
    # In plain epochs the scheduler spares the per-request counts (64 entries a step at batch
    # 64, which no plain epoch reads): the step's tokens alone.
    plain = [h for h in heard if h[2] and h[1] == 4 and h[4] is False]
    assert plain and all(h[3] is None for h in plain)
    assert any(0 in h[3].values() for h in decoding)  # a request sat a step out
    assert any(max(h[3].values()) > 1 for h in decoding)  # drafts accepted
    first = [on for *_, on in heard if on is not None]
    assert first and first[0] is False  # the bucket's first epoch is plain


def test_a_stalled_step_does_not_decide() -> None:
    """A step 50 times slower than the others (another process, a collector pause) in an epoch
    of plain steps is left out: drafting, which pays a little, stays on."""
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    steps = {"n": 0}

    def stalls_once(on: bool) -> tuple[float, float]:
        steps["n"] += 1
        seconds, tokens = (1.1e-3, 1.5) if on else (1.0e-3, 1.0)
        return (seconds * 50 if steps["n"] == 18 else seconds), tokens  # in the first plain epoch

    modes = _run(gov, clock, 40, 8, stalls_once)
    assert not modes[12] and not modes[17], modes  # step 18 fell in the plain probe
    rate = gov.buckets[gov.bucket_of(8)].rate
    assert rate[False] == pytest.approx(1000.0) and rate[True] > rate[False]
    assert all(modes[22:])


def test_turnover_probes_back_off_while_drafting_keeps_losing() -> None:
    """At batch 1 every new request turns the batch over: a proposer whose drafts never pay
    would cost a drafting epoch per request; probes that keep losing wait for ever more."""

    def drafted_per_request(gov: SpeculationGovernor, clock: FakeClock) -> list[int]:
        per = []
        for _ in range(40):
            gov.admit(1)
            per.append(sum(_run(gov, clock, 160, 1, _host_bound)))
        return per

    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    per = drafted_per_request(gov, clock)
    assert gov.buckets[gov.bucket_of(1)].turnovers > 1
    assert sum(per[20:]) <= 0.05 * 20 * 160  # probes of the later requests: at most 5% of steps
    assert per[20:].count(0) >= 8  # whole requests go by without a probe
    every = SpeculationGovernor(clock=FakeClock(), max_turnovers=1)  # a probe at each turnover
    assert all(drafted_per_request(every, every.clock)[1:])


def test_a_turnover_probe_that_wins_brings_probing_back_to_every_turnover() -> None:
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    for _ in range(40):
        gov.admit(1)
        _run(gov, clock, 160, 1, _host_bound)
    bucket = gov.buckets[gov.bucket_of(1)]
    assert bucket.turnovers > 1 and not bucket.best
    for _ in range(4):  # the workload changes: drafts now pay
        gov.admit(1)
        _run(gov, clock, 400, 1, _drafts_pay)
    assert bucket.best and bucket.turnovers == 1


def test_auto_drafts_switch_mode_at_a_bucket_boundary() -> None:
    """Speculation changes from draft slots to alternating steps at a bucket boundary, so that no
    bucket's drafting rate mixes the two."""
    below, at = (
        SpeculationGovernor.bucket_of(draft_policy.ALTERNATE_FROM - 1),
        SpeculationGovernor.bucket_of(draft_policy.ALTERNATE_FROM),
    )
    assert below != at
    assert SpeculationGovernor.bucket_of(2 * draft_policy.ALTERNATE_FROM - 1) == at


def test_drafting_that_accepts_nothing_loses_whatever_the_clock_shows() -> None:
    """A draft head whose drafts are all rejected (or a proposer that backs off on its own and
    drafts nothing) emits one token a request per forward, as plain steps do: its epochs can
    measure faster only while the host or device sped up. Plain steps win, and drafting is
    probed as rarely as a confirmed choice allows."""
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    # Drafting epochs happen to run 10% faster (noise), accepting nothing.
    modes = _run(gov, clock, 1500, 4, lambda on: (0.9e-3, 1.0) if on else (1e-3, 1.0))
    bucket = gov.buckets[gov.bucket_of(4)]
    assert bucket.gain == pytest.approx(1.0) and not bucket.best
    assert bucket.rate[True] > bucket.rate[False]  # as measured; the choice ignores it
    late = modes[300:]
    assert sum(late) / len(late) < 0.06, sum(late)
    assert gov.epochs[True] <= 8, gov.epochs
    # The same clock with drafts accepted (1.3 tokens a forward): drafting wins.
    paying = SpeculationGovernor(clock=FakeClock())
    modes = _run(paying, paying.clock, 1500, 4, lambda on: (0.9e-3, 1.3) if on else (1e-3, 1.0))
    assert paying.buckets[paying.bucket_of(4)].best and sum(modes[300:]) > 0.95 * 1200


def test_a_drafting_rate_beyond_its_gain_is_capped_at_it() -> None:
    """Drafting that accepts a few drafts (1.05 tokens a forward) cannot be more than 5% faster
    than plain steps, whatever one fast drafting epoch measured; the cap keeps a near tie a near
    tie, not a 60% win that would space plain probes out."""
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    modes = _run(gov, clock, 600, 20, lambda on: (0.6e-3, 1.05) if on else (1e-3, 1.0))
    bucket = gov.buckets[gov.bucket_of(20)]
    assert bucket.rate[True] > 1.5 * bucket.rate[False]  # measured
    assert gov._rates(bucket)[True] == pytest.approx(1.05 * bucket.rate[False], rel=1e-3)
    # 5% beyond the 2% margin: drafting still wins, and a plain probe is cheap (it loses 5%,
    # not 40%): its cost does not space probes out (confirmations alone do).
    assert bucket.best and sum(modes[-200:]) > 0.9 * 200
    assert gov._spacing(bucket) == 4  # 1.5 epochs x 5% / 2%; 32 for the measured 43% loss


def test_drafting_must_measure_clearly_faster_to_replace_plain_steps() -> None:
    """What a switch to drafting costs beyond its epoch is not measured (its settling steps, a
    batch left uneven): from plain steps, drafting needs ``draft_margin`` (10%) more tokens a
    second to be chosen; 5% more keeps plain steps. Once chosen, drafting keeps a near tie."""

    def five_percent(on: bool) -> tuple[float, float]:
        return (1.2e-3, 1.26) if on else (1e-3, 1.0)  # drafting 1.05x plain

    def fifteen_percent(on: bool) -> tuple[float, float]:
        return (1.2e-3, 1.38) if on else (1e-3, 1.0)  # 1.15x

    for cost, drafts in ((five_percent, False), (fifteen_percent, True)):
        clock = FakeClock()
        gov = SpeculationGovernor(clock=clock)
        gov.buckets[gov.bucket_of(64)] = gov._bucket(gov.bucket_of(64))
        gov.buckets[gov.bucket_of(64)].best = False  # plain steps first
        modes = _run(gov, clock, 1500, 64, cost)
        assert gov.buckets[gov.bucket_of(64)].best is drafts
        assert (sum(modes[500:]) > 0.9 * 1000) is drafts, sum(modes[500:])
    # Drafting chosen first (a fresh bucket drafts) keeps 5%: plain needs 2% to replace it.
    clock = FakeClock()
    gov = SpeculationGovernor(clock=clock)
    modes = _run(gov, clock, 1500, 64, five_percent)
    assert gov.buckets[gov.bucket_of(64)].best and sum(modes[500:]) > 0.9 * 1000
