"""``DraftPause``: a request the proposer keeps finding no draft for pauses between probes
(1, 2, 4 ... up to ``max_pause`` steps, through ``resume_at``), a draft found ends the pause;
and the n-gram proposer at its defaults pauses so, on the engine too: its steps with slots then
launch without waiting for the step in flight, and greedy output is unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.spec_decode import DraftPause
from pagoda.step import DRAFT_SLOT
from pagoda.worker import draft_slots, model_runner


def test_pauses_double_after_the_patience_and_end_at_a_draft() -> None:
    resume: dict[str, int] = {}
    pause = DraftPause(resume, patience=2, max_pause=4)  # (the defaults: 3 and 8)
    ids = ["a", "b"]

    def call(n: int, found: list[bool]) -> None:
        pause.update(ids, np.array([n, n]), np.array(found))

    call(10, [False, True])
    assert resume == {} and not pause.paused  # one miss: still asked every step
    call(11, [False, True])
    assert resume == {"a": 13}  # asked again once it knows 13 tokens: 1 step skipped
    call(13, [False, True])
    assert resume == {"a": 16}  # 2 skipped
    call(16, [False, False])
    assert resume == {"a": 21}  # 4 skipped (the most), "b" missed once only
    call(21, [False, False])
    assert resume == {"a": 26, "b": 23}
    call(26, [True, False])  # a draft ends "a"'s pause and its count
    assert resume == {"b": 29}
    call(27, [False, True])
    assert resume == {}  # "a" missed once again: not paused; "b" found one
    pause.forget(["a", "b"])
    assert pause._misses == {} and not pause.paused


def test_ngram_at_its_defaults_pauses_and_its_slot_steps_stop_waiting(monkeypatch) -> None:
    # Random weights, greedy, a prompt without repeats: the n-gram proposer seldom finds a
    # draft. At batch 1 every step has draft slots; paused, they no longer wait for the step in
    # flight (``draft_slots.paused``), and the output is the one without speculation.
    from test_verify_graph_layout import TINY

    folder, _ = ensure_random_weights(TINY, 0, torch.device("cpu"))
    engine = {"device": "cpu", "max_model_len": 256, "max_num_seqs": 1}
    prompt = [{"prompt_token_ids": list(range(20, 60))}]
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    want = LLM(model=str(folder), **engine).generate(prompt, params, use_tqdm=False)
    llm = LLM(model=str(folder), **engine, speculative_config={"method": "ngram"})
    proposer = llm.engine.engine_core.executor.worker.model_runner.spec.proposer
    assert proposer.pause is not None  # the draft length is the proposer's own
    skipped: list[bool] = []
    paused = draft_slots.paused

    def spy(*args) -> bool:
        skipped.append(paused(*args))
        return skipped[-1]

    monkeypatch.setattr(draft_slots, "paused", spy)
    # A launch whose slots are all paused's: whether it read the step in flight anyway.
    waited_for_nothing: list[bool] = []
    propose_for_slots = draft_slots.propose_for_slots

    def watch(spec, scheduled) -> None:
        step = spec.in_flight.last
        unread = step is not None and not step.done
        all_paused = step is not None and all(
            paused(spec, step, r) for r, ids in scheduled.items() if draft_slots.is_draft_slots(ids)
        )
        propose_for_slots(spec, scheduled)
        if unread and all_paused:
            waited_for_nothing.append(step.done)

    monkeypatch.setattr(model_runner, "propose_for_slots", watch)
    got = llm.generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert sum(skipped) > 20, skipped  # launches with slots that did not wait
    # ... and did not read the step in flight for a proposal they would not take
    assert len(waited_for_nothing) > 20 and not any(waited_for_nothing), waited_for_nothing
    # With the draft length given, every request is asked every step (vLLM's way).
    fixed = LLM(
        model=str(folder),
        **engine,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    assert fixed.engine.engine_core.executor.worker.model_runner.spec.proposer.pause is None


class _Step:
    """A step in flight, read or not (``reads``: the reads that waited for it); no request
    verified drafts in it."""

    drafted = None

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.reads = 0

    def get(self) -> None:
        self.reads += not self.done
        self.done = True


def _spec(step: _Step, resume: dict[str, int]):
    from types import SimpleNamespace

    ib = SimpleNamespace(row_of={"a": 0, "b": 1}, num_tokens=np.array([10, 10]))
    return SimpleNamespace(
        in_flight=SimpleNamespace(last=step),
        proposer=SimpleNamespace(resume_at=resume),
        input_batch=ib,
        num_spec_tokens=4,
        proposals={},
    )


@pytest.mark.parametrize(
    "paused,done,read,asked",
    [
        ({"a", "b"}, False, False, set()),  # all paused: no wait, nothing asked, slots empty
        ({"a"}, False, True, {"b"}),  # read for "b" ("a" is left to ``propose``'s own check)
        ({"a", "b"}, True, False, set()),  # read already: no wait
        (set(), False, True, {"a", "b"}),
    ],
)
def test_slots_read_the_step_in_flight_unless_all_are_paused(
    monkeypatch, paused, done, read, asked
) -> None:
    step = _Step(done)
    spec = _spec(step, {r: 12 for r in paused})  # (12 > the 10 tokens known: paused)
    got: list[str] = []
    monkeypatch.setattr(draft_slots, "propose", lambda spec, step, out, slots: got.extend(slots))
    slots = [DRAFT_SLOT] * 4
    draft_slots.propose_for_slots(spec, {"a": slots, "b": slots})
    assert (step.reads == 1) == read and asked <= set(got)
    if not read and not done:
        assert not got
