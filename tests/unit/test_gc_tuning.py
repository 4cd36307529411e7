"""The collector tuning of the engine-core process (``pagoda.process``): objects alive at
start are frozen, the youngest generation's threshold goes up (never down, and a collector turned
off stays off), and ``tuned_gc`` undoes both, so that a benchmark's process goes on as before;
``steps_gc``, around ``LLM``'s batch calls, freezes for the call alone."""

from __future__ import annotations

import gc
import weakref

import pytest

import pagoda.process as process
from pagoda.process import GEN0, steps_gc, tune_gc, tuned_gc


@pytest.fixture(autouse=True)
def _restore():
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    process._tuned[0] = False
    gc.set_threshold(*before)


def test_tune_gc_freezes_what_is_alive_and_raises_the_first_threshold() -> None:
    gc.set_threshold(700, 10, 10)
    assert tune_gc() == (700, 10, 10)
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (GEN0, 10, 10)


def test_a_higher_threshold_or_a_collector_turned_off_stays() -> None:
    gc.set_threshold(50_000, 10, 10)
    tune_gc()
    assert gc.get_threshold() == (50_000, 10, 10)
    gc.set_threshold(0, 10, 10)
    tune_gc()
    assert gc.get_threshold() == (0, 10, 10)


class _Node:
    pass


def _cycle() -> tuple[_Node, weakref.ref]:
    """A reference cycle (once its one holder lets go, only the collector frees it): one of its
    nodes, and a weak reference to it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


def test_tuned_gc_undoes_itself_and_cycles_made_before_it_are_collected_after() -> None:
    gc.set_threshold(700, 10, 10)
    held, alive = _cycle()
    with tuned_gc():
        assert gc.get_threshold() == (GEN0, 10, 10)
        assert gc.get_freeze_count() > 0
        del held
        gc.collect()
        assert alive() is not None  # frozen: the collector does not walk it
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None


def test_steps_gc_freezes_for_the_call_alone_and_collects_nothing_first() -> None:
    gc.set_threshold(700, 10, 10)
    held, alive = _cycle()
    del held  # garbage before the call: steps_gc does not collect it first
    with steps_gc():
        assert gc.get_threshold() == (GEN0, 10, 10)
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert alive() is not None  # (garbage from before the call waits for after it)
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None


def test_steps_gc_inside_a_frozen_process_leaves_its_freeze() -> None:
    gc.set_threshold(700, 10, 10)
    held, alive = _cycle()
    with tuned_gc():
        del held  # frozen garbage: only an unfreeze would let the collector free it
        with steps_gc():
            assert gc.get_threshold() == (GEN0, 10, 10)
        assert gc.get_freeze_count() > 0
        gc.collect()
        # Not unfrozen by the inner call. (The freeze count itself is no witness: another
        # thread dropping a frozen object lowers it.)
        assert alive() is not None
    gc.collect()
    assert alive() is None
    gc.disable()
    try:
        with steps_gc():
            assert gc.get_freeze_count() == 0  # a collector turned off: nothing to do
    finally:
        gc.enable()


def test_llm_calls_run_their_steps_frozen(monkeypatch) -> None:
    """``LLM``'s batch calls step the engine inside ``steps_gc`` (the threshold raised while
    the engine steps, back after)."""
    from pagoda.entrypoints import llm as llm_module

    gc.set_threshold(700, 10, 10)
    seen = []

    class Engine:
        def has_unfinished_requests(self):
            return True

        def step(self):
            seen.append((gc.get_threshold()[0], gc.get_freeze_count() > 0))
            return [type("Out", (), {"finished": True, "request_id": "r"})()]

        def abort_request(self, ids):
            pass

    llm = object.__new__(llm_module.LLM)
    llm.engine = Engine()
    assert len(llm._run(["r"], False)) == 1
    assert seen == [(GEN0, True)]
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0


def test_a_batch_call_does_not_count_the_frozen_objects(monkeypatch) -> None:
    # ``gc.get_freeze_count()`` walks every frozen object: tens of milliseconds a call in a
    # process that froze torch and a model, which each ``LLM.generate`` call used to pay.
    def walk() -> int:
        raise AssertionError("steps_gc counted the frozen objects")

    tune_gc()
    monkeypatch.setattr(gc, "get_freeze_count", walk)
    with steps_gc():
        assert gc.get_threshold()[0] >= GEN0
    monkeypatch.undo()
    assert gc.get_freeze_count() > 0  # tune_gc's freeze outlives the call
