"""``LLM``'s batches reach the engine a step's worth at a time (``StepAdmission``): the first step
starts once it is full, the waiting queue never runs short of a step, and a refused request
takes the requests added before it with it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagoda.engine.admission import StepAdmission


class _Engine:
    def __init__(self, tokens: int, seqs: int) -> None:
        self.info = SimpleNamespace(max_num_batched_tokens=tokens)
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=seqs))
        self.n = 0
        self.added: list[str] = []
        self.aborted: list[str] = []

    def new_request_id(self) -> str:
        self.n += 1
        return f"r{self.n}"

    def abort_request(self, ids: list[str]) -> None:
        self.aborted += ids


def _admission(engine: _Engine, lens: list[int], refuse: int | None = None, **kw) -> StepAdmission:
    def add(i: int, rid: str) -> int:
        if i == refuse:
            raise ValueError(f"request {i} refused")
        engine.added.append(rid)
        return lens[i]

    return StepAdmission(engine, len(lens), add, **kw)


def test_each_top_up_adds_one_step_of_tokens_then_of_requests() -> None:
    engine = _Engine(tokens=1000, seqs=4)
    adm = _admission(engine, [300] * 10)
    assert adm.ids == [f"r{i}" for i in range(1, 11)]  # every id known before any is added
    adm.top_up()
    assert engine.added == ["r1", "r2", "r3", "r4"]  # 1,200 tokens: the budget is full
    adm.top_up()
    assert len(engine.added) == 8
    adm.top_up()
    adm.top_up()  # nothing left: nothing happens
    assert engine.added == adm.ids == adm.added
    short = _Engine(tokens=1000, seqs=4)
    adm = _admission(short, [10] * 10)
    adm.top_up()
    assert len(short.added) == 4  # short prompts: the step's request limit binds first


def test_priorities_add_every_request_at_once() -> None:
    engine = _Engine(tokens=1000, seqs=4)
    _admission(engine, [300] * 10, at_once=True).top_up()
    assert len(engine.added) == 10


def test_a_refused_request_aborts_those_added_before_it() -> None:
    engine = _Engine(tokens=1000, seqs=4)
    adm = _admission(engine, [300] * 10, refuse=6)
    adm.top_up()
    with pytest.raises(ValueError, match="request 6 refused"):
        adm.top_up()
    assert engine.aborted == ["r1", "r2", "r3", "r4", "r5", "r6"]
    assert adm.added == engine.aborted
