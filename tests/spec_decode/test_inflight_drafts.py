"""Speculation under async scheduling: a request whose step is still running gets draft slots,
which the runner fills with drafts proposed from the tokens that step produced, so acceptance is
as high as when every step waits; requests whose drafts keep failing back off, so that most
steps carry no drafts and overlap the device; greedy output never changes, and the KV cache's
bookkeeping holds after every step (optimistic slots are trimmed, nothing leaks)."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams, hookimpl
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.scheduler import draft_policy
from pagoda.scheduler.draft_policy import DraftBackoff
from pagoda.spec_decode import Drafts, SpeculativeProposer
from pagoda.testing import plugin_registered
from pagoda.testing.kv_cache import check_kv_cache

TINY = Path(__file__).parents[2] / "benchmarks" / "configs" / "tiny-llama"
K = 3
MAX_TOKENS = 48
# Reference continuations by prompt, which the oracle proposer reads (set by the fixture).
REFERENCE: dict[tuple[int, ...], list[int]] = {}
# Where speculation alternates from (``draft_policy.ALTERNATE_FROM``), to run this batch of 8 in
# each of the two ways: draft slots every step, alternating every step, or the engine's own split.
REGIMES = {"slots": 9, "alternate": 1, "auto": None}


def _regime(monkeypatch, regime: str) -> None:
    if REGIMES[regime] is not None:
        monkeypatch.setattr(draft_policy, "ALTERNATE_FROM", REGIMES[regime])


class OracleProposer(SpeculativeProposer):
    """Drafts the reference continuation (``shift`` 0: always right) or that plus ``shift``
    modulo the vocabulary (always wrong)."""

    shift = 0
    proposed = 0  # requests proposed for, over all calls

    def propose(self, batch):
        type(self).proposed += len(batch)
        k = self.ctx.num_speculative_tokens
        out = np.full((len(batch), k), -1, dtype=np.int64)
        for i in range(len(batch)):
            prompt = tuple(batch.token_ids[batch.rows[i], : batch.num_prompt_tokens[i]].tolist())
            done = int(batch.num_tokens[i] - batch.num_prompt_tokens[i])
            cont = REFERENCE[prompt][done : done + k]
            out[i, : len(cont)] = (np.asarray(cont) + self.shift) % self.ctx.vocab_size
        return Drafts(out)


class WrongProposer(OracleProposer):
    shift = 1


@hookimpl
def register_spec_proposers(register):
    register("oracle", OracleProposer)
    register("wrong", WrongProposer)


@pytest.fixture(scope="module")
def setup():
    folder, _ = ensure_random_weights(TINY, 0, torch.device("cpu"))
    engine = dict(
        model=str(folder),
        device="cpu",
        max_model_len=256,
        max_num_seqs=8,
        kv_cache_memory_bytes=16 << 20,
    )
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, 1000, int(n)).tolist() for n in (9, 30, 17, 4, 23, 12, 6, 15)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = _generate(LLM(**engine), prompts, params)
    REFERENCE.clear()
    REFERENCE.update({tuple(p): w for p, w in zip(prompts, want)})
    plugin = types.ModuleType("inflight_test_proposers")
    plugin.PAGODA_PLUGIN_API = 1
    plugin.register_spec_proposers = register_spec_proposers
    with plugin_registered(plugin):
        yield engine, prompts, params, want


def _generate(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _instrumented(llm: LLM) -> dict[str, int]:
    """Counts steps, steps with draft slots or drafts, and the runner's waits for the step in
    flight inside a launch; checks the KV cache after every step."""
    core = llm.engine.engine_core
    runner = core.executor.worker.model_runner
    seen = {"steps": 0, "with_drafts": 0, "slots": 0, "waits": 0}
    schedule, read = core.scheduler.schedule, runner.in_flight.read_all

    def counting_schedule():
        so = schedule()
        seen["steps"] += not so.is_empty
        seen["with_drafts"] += bool(so.scheduled_spec_decode_tokens)
        seen["slots"] += sum(d[0] < 0 for d in so.scheduled_spec_decode_tokens.values())
        check_kv_cache(core.kv_cache_manager, core.scheduler)
        return so

    def counting_read():
        seen["waits"] += any(not s.done for s in runner.in_flight.unread)
        read()

    core.scheduler.schedule = counting_schedule
    runner.in_flight.read_all = counting_read
    return seen


@pytest.mark.parametrize("regime", list(REGIMES))
def test_async_drafts_are_fresh(setup, regime, monkeypatch) -> None:
    """Draft slots filled once the step in flight is read, or (alternating) requests that sit
    out a step and draft from its tokens: either way no draft is stale."""
    engine, prompts, params, want = setup
    _regime(monkeypatch, regime)
    # (drafting every step: the governor would start batch 8 with a plain epoch where steps
    # alternate, and the step count below is of drafting steps)
    spec = {"method": "oracle", "num_speculative_tokens": K, "adaptive": False}
    llm = LLM(**engine, speculative_config=spec, async_scheduling=True)
    seen = _instrumented(llm)
    assert _generate(llm, prompts, params) == want
    stats = llm.engine.engine_core.scheduler.spec_stats_total
    # Every draft is the target's own token: all are accepted although each step was scheduled
    # before the previous one's tokens were known.
    assert stats.acceptance_rate > 0.95, stats
    assert stats.mean_acceptance_length > K + 0.5, stats
    assert seen["steps"] < 2 + MAX_TOKENS / (K + 1) * 1.5, seen
    core = llm.engine.engine_core
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1


def test_speculation_switches_between_slots_and_alternating_steps(setup, monkeypatch) -> None:
    """Alternating steps while many requests run, draft slots once few do, and requests cross
    between the two with steps in flight; drafts stay fresh (the oracle's are all accepted),
    output stays exact, and every block returns."""
    engine, prompts, params, want = setup
    assert draft_policy.ALTERNATE_FROM == 8
    # NOTE: from 4 running requests on, so that this batch of 8 (whose requests end one by one)
    # spends steps in both ways and switches while requests have steps in flight.
    monkeypatch.setattr(draft_policy, "ALTERNATE_FROM", 4)
    spec = {"method": "oracle", "num_speculative_tokens": K}
    llm = LLM(**engine, speculative_config=spec, async_scheduling=True)
    core = llm.engine.engine_core
    assert core.scheduler.spec_alternate_from == core.scheduler.draft_backoff.min_batch == 4
    _instrumented(llm)  # (checks the KV cache's bookkeeping after every step)
    modes = {"alternate": 0, "slots": 0}
    schedule = core.scheduler.schedule

    def recording_schedule():
        so = schedule()
        spec_tokens = so.scheduled_spec_decode_tokens.values()
        if any(d[0] < 0 for d in spec_tokens):
            modes["slots"] += 1
        elif spec_tokens and so.alternate_drafts:  # drafts proposed two steps before
            modes["alternate"] += 1
        return so

    core.scheduler.schedule = recording_schedule
    lengths = [8, 12, 16, 24, 32, 40, 44, 48]
    ragged = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    got = _generate(llm, prompts, ragged)
    assert got == [w[:n] for w, n in zip(want, lengths)]
    assert modes["alternate"] > 0 and modes["slots"] > 0, modes
    stats = core.scheduler.spec_stats_total
    assert stats.acceptance_rate > 0.95, stats
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1


@pytest.mark.parametrize(
    ("async_scheduling", "regime"),
    [(True, "slots"), (True, "alternate"), (True, "auto"), (False, "auto")],
)
def test_always_rejected_drafts_back_off_to_plain_steps(
    setup, async_scheduling, regime, monkeypatch
) -> None:
    engine, prompts, params, want = setup
    _regime(monkeypatch, regime)
    spec = {"method": "wrong", "num_speculative_tokens": K}
    llm = LLM(**engine, speculative_config=spec, async_scheduling=async_scheduling)
    seen = _instrumented(llm)
    WrongProposer.proposed = 0
    assert _generate(llm, prompts, params) == want
    stats = llm.engine.engine_core.scheduler.spec_stats_total
    assert stats.num_drafts and stats.num_accepted_tokens == 0, stats
    # Backing off, requests draft in about 1 step of 16 (aligned), after a few misses each.
    assert seen["with_drafts"] <= seen["steps"] * 0.3, seen
    if async_scheduling and regime != "slots":
        # (8 requests: every step alternates.) Requests with drafts in flight sit the next step
        # out: the runner never waits.
        assert seen["waits"] == 0, seen
    elif async_scheduling:
        # The runner waits for the step in flight only around steps with drafts: to fill the
        # slots of one, and to learn the lengths its requests reached before the next.
        assert seen["waits"] <= 2 * seen["with_drafts"] + 1, seen
        # A proposer that reads only history is asked only for requests with draft slots.
        assert 0 < WrongProposer.proposed <= seen["slots"], (WrongProposer.proposed, seen)
    core = llm.engine.engine_core
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1


def test_backoff_doubles_the_period_after_each_miss_and_resets_on_an_accept() -> None:
    backoff = DraftBackoff()

    def drafting_steps(n: int) -> list[int]:
        steps = []
        for _ in range(n):
            backoff.tick()
            if backoff.allows("r", 8):
                steps.append(backoff.step)
                backoff.observe("r", 3, 0)
        return steps

    # Two misses, then every 2nd, 4th, 8th, 16th step (multiples of the period: requests at the
    # same level draft in the same steps), capped at 16.
    assert drafting_steps(80) == [1, 2, 4, 8, 16, 32, 48, 64, 80]
    backoff.observe("r", 3, 1)  # an accepted draft: back to every step
    assert backoff.allows("r", 8)
    backoff.observe("r", 0, 0)  # no draft found counts as a miss too
    backoff.observe("r", 3, 0)
    backoff.tick()  # step 81: odd
    assert not backoff.allows("r", 8)
    assert backoff.allows("r", 7)  # a small batch never backs off
    backoff.tick()
    assert backoff.allows("r", 8)
    backoff.tick()
    backoff.forget("r")
    assert backoff.allows("r", 8)


def test_alternating_drafts_back_off_at_batch_1_too(setup, monkeypatch) -> None:
    """With alternating drafts a miss costs the step the request sits out, at any batch size:
    a lone request whose drafts always miss drafts in few steps."""
    engine, prompts, params, want = setup
    _regime(monkeypatch, "alternate")
    spec = {"method": "wrong", "num_speculative_tokens": K}
    spec["adaptive"] = False  # (the back-off alone)
    llm = LLM(**{**engine, "max_num_seqs": 1}, speculative_config=spec, async_scheduling=True)
    seen = _instrumented(llm)
    assert _generate(llm, prompts[:2], params) == want[:2]
    stats = llm.engine.engine_core.scheduler.spec_stats_total
    assert stats.num_drafts and stats.num_accepted_tokens == 0, stats
    assert seen["with_drafts"] <= seen["steps"] * 0.3, seen
    assert seen["waits"] == 0, seen
