"""While the speculation governor has drafting off, a draft head is not asked (its drafts would
be scheduled nowhere, and a catch-up draft costs several plain steps); the target's hidden
states wait in the runner's feed, at most ``HiddenFeed.max_hold`` positions a request, and the
head catches up on them once drafting is back on. Greedy output is unchanged throughout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from eagle_helpers import TINY_LLAMA, write_random_head
from pagoda_spec_eagle.proposer import EagleProposer

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.worker.hidden_states import HiddenFeed

ENGINE = {"device": "cpu", "max_model_len": 512, "max_num_seqs": 1, "async_scheduling": True}


class _Switch:
    """A governor stand-in: drafting on for ``on`` steps, then off for the rest."""

    fixed = False
    counts_requests = False  # (reads no request's tokens)

    def __init__(self, on: int) -> None:
        self.on, self.steps = on, 0

    def drafting(self, num_running: int) -> bool:
        self.steps += 1
        return self.steps <= self.on

    def observe(self, *args, **kwargs) -> None: ...

    def admit(self, num_requests: int) -> None: ...

    def idle(self) -> None: ...


def test_a_head_is_not_asked_while_drafting_is_off(tmp_path: Path, monkeypatch) -> None:
    folder, _ = ensure_random_weights(TINY_LLAMA, 0, torch.device("cpu"))
    prompt = [{"prompt_token_ids": list(range(20, 60))}]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    want = LLM(model=str(folder), **ENGINE).generate(prompt, params, use_tqdm=False)
    head = write_random_head(tmp_path / "h", "eagle3", 64, 1024, draft_vocab=256)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(model=str(folder), **ENGINE, speculative_config=spec)
    core = llm.engine.engine_core
    core.scheduler.spec_governor = _Switch(on=30)
    runner = core.executor.worker.model_runner
    feed = runner.spec.hidden_feed
    asked, held = [], []
    propose = EagleProposer.propose

    def spy_propose(self, batch):
        asked.append(core.scheduler.spec_governor.steps)
        return propose(self, batch)

    monkeypatch.setattr(EagleProposer, "propose", spy_propose)
    defer = feed.defer

    def spy_defer(*args, **kwargs) -> None:
        defer(*args, **kwargs)
        # (``pending`` holds what was deferred, as the head's next catch-up would)
        held.append(max((n for _, _, n in feed.pending.values()), default=0))

    feed.defer = spy_defer
    got = llm.generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert asked and max(asked) <= 32, asked  # asked while drafting was on (a step's lag)
    assert len(held) > 150 and max(held) == feed.max_hold  # bounded while off
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1


class _Phases(_Switch):
    """Drafting on for ``on`` steps, off for ``off``, then on again."""

    def __init__(self, on: int, off: int) -> None:
        super().__init__(on)
        self.off = off

    def drafting(self, num_running: int) -> bool:
        self.steps += 1
        return not self.on < self.steps <= self.on + self.off


def _catch_ups(folder: Path, head: Path, monkeypatch, eager: bool) -> tuple[list, dict]:
    """The head's calls once drafting is back on (request ids, first positions, rows), and what
    the feed holds when the requests are done; ``eager``: each deferred step is held at once."""
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    engine = {**ENGINE, "max_num_seqs": 2}
    llm = LLM(model=str(folder), **engine, speculative_config=spec)
    core = llm.engine.engine_core
    core.scheduler.spec_governor = gov = _Phases(on=12, off=40)
    feed = core.executor.worker.model_runner.spec.hidden_feed
    if eager:
        monkeypatch.setattr(
            feed, "defer", lambda step: (HiddenFeed.defer(feed, step), feed._flush())
        )
    calls = []
    propose = EagleProposer.propose

    def spy(self, batch):
        if gov.steps > gov.on + gov.off and batch.new_hidden_states is not None:
            m = np.diff(batch.hidden_loc)
            first = batch.num_tokens - 1 - m
            calls.append((list(batch.req_ids), first.tolist(), batch.new_hidden_states.clone()))
        return propose(self, batch)

    monkeypatch.setattr(EagleProposer, "propose", spy)
    prompts = [{"prompt_token_ids": list(range(20, 60))}, {"prompt_token_ids": list(range(7, 30))}]
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(EagleProposer, "propose", propose)
    return calls, {r: (first, n) for r, (first, _, n) in feed.pending.items()}


def test_deferred_steps_feed_the_catch_up_what_holding_each_step_would(
    tmp_path: Path, monkeypatch
) -> None:
    """While drafting is off, a step's rows are only deferred (one append), and held when the
    feed is next used: the head's catch-up gets the same rows, from the same positions, as if
    each step had been held when it was read, and what waits at the end is the same."""
    folder, _ = ensure_random_weights(TINY_LLAMA, 0, torch.device("cpu"))
    head = write_random_head(tmp_path / "h", "eagle3", 64, 1024, draft_vocab=256)
    lazy, lazy_left = _catch_ups(folder, head, monkeypatch, eager=False)
    eager, eager_left = _catch_ups(folder, head, monkeypatch, eager=True)
    assert lazy and len(lazy) == len(eager)
    first_ids, first_pos, first_rows = lazy[0]
    # The first call back catches up on the stretch drafting was off (40 steps, under max_hold).
    assert first_rows.shape[0] >= 2 * 40, first_rows.shape
    for (ids, pos, rows), (ids_e, pos_e, rows_e) in zip(lazy, eager, strict=True):
        assert ids == ids_e and pos == pos_e
        torch.testing.assert_close(rows, rows_e, rtol=0, atol=0)
    assert lazy_left == eager_left


class _Flip(_Switch):
    """Drafting on and off in turns of ``every`` steps."""

    def __init__(self, every: int) -> None:
        super().__init__(0)
        self.every = every

    def drafting(self, num_running: int) -> bool:
        self.steps += 1
        return (self.steps // self.every) % 2 == 1


def test_preemption_while_steps_are_deferred_keeps_greedy_output(tmp_path: Path) -> None:
    """A KV cache too small for the batch preempts requests while drafting is off and their
    steps wait, deferred, in the feed: a preempted request comes back under its id and
    recomputes; output is unchanged, and no rows wait for a request that ended."""
    folder, _ = ensure_random_weights(TINY_LLAMA, 0, torch.device("cpu"))
    rng = np.random.default_rng(5)
    lengths = (30, 9, 50, 21)
    prompts = [{"prompt_token_ids": rng.integers(10, 300, n).tolist()} for n in lengths]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    engine = {**ENGINE, "max_model_len": 128, "max_num_seqs": 4, "num_gpu_blocks_override": 10}
    plain = LLM(model=str(folder), **engine)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    head = write_random_head(tmp_path / "h", "eagle3", 64, 1024, draft_vocab=256)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(model=str(folder), **engine, speculative_config=spec)
    core = llm.engine.engine_core
    core.scheduler.spec_governor = _Flip(every=9)
    preempt, preempted = core.scheduler._preempt, []

    def counting_preempt(req, step):
        preempted.append(req.request_id)
        return preempt(req, step)

    core.scheduler._preempt = counting_preempt
    feed = core.executor.worker.model_runner.spec.hidden_feed
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert preempted, "the cache was meant to be too small for the batch"
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # ends the first batch
    assert not {o.request_id for o in outs} & set(feed.pending)
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1
