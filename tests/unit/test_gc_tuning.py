"""The collector tuning of the engine-core process (``pagoda.process``): objects alive at
start are frozen, the youngest generation's threshold goes up (never down, and a collector turned
off stays off), and ``tuned_gc`` undoes both, so that a benchmark's process goes on as before."""

from __future__ import annotations

import gc
import weakref

import pytest

from pagoda.process import GEN0, tune_gc, tuned_gc


@pytest.fixture(autouse=True)
def _restore():
    before = gc.get_threshold()
    yield
    gc.unfreeze()
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


def test_tuned_gc_undoes_itself_and_cycles_made_before_it_are_collected_after() -> None:
    gc.set_threshold(700, 10, 10)

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a reference cycle: only the collector frees it
    alive = weakref.ref(a)
    with tuned_gc():
        assert gc.get_threshold() == (GEN0, 10, 10)
        assert gc.get_freeze_count() > 0
        del a, b
        gc.collect()
        assert alive() is not None  # frozen: the collector does not walk it
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
