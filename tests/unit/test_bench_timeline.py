"""``pagoda.bench.timeline``: ranges put around methods and functions and taken off again, and
the device's idle time split by the innermost host range under way."""

from __future__ import annotations

import types

import torch
from torch.profiler import profile

from pagoda.bench import timeline
from pagoda.bench.timeline import PREFIX, _split, annotated, timed


class Worker:
    def run(self, x: int) -> int:
        return x + 1


def test_annotated_ranges_calls_and_restores_what_it_wrapped() -> None:
    w = Worker()
    mod = types.SimpleNamespace(step=lambda: 7)
    own = Worker()
    own.run = lambda x: x * 10  # an attribute of the object itself, not its class
    with profile() as prof, annotated([(w, "run", "run"), (mod, "step", "step"),
                                       (own, "run", "own"), (None, "x", "none"),
                                       (w, "missing", "missing")]):  # fmt: skip
        assert w.run(1) == 2 and mod.step() == 7 and own.run(2) == 20
    names = [e.name for e in prof.events()]
    for label in ("run", "step", "own"):
        assert names.count(PREFIX + label) == 1
    assert "run" not in w.__dict__  # the class's method again
    assert own.run(3) == 30 and mod.step() == 7  # their own callables again
    assert not any(n.startswith(PREFIX + "missing") for n in names)


def test_timed_records_each_call_even_one_that_raises_and_restores() -> None:
    w = Worker()
    calls: list[tuple[str, int, int]] = []

    def fail() -> None:
        raise ValueError("no")

    mod = types.SimpleNamespace(fail=fail)
    with timed([(w, "run", "run"), (mod, "fail", "fail")], lambda *c: calls.append(c)):
        assert w.run(1) == 2 and w.run(2) == 3
        try:
            mod.fail()
        except ValueError:
            pass
    assert [c[0] for c in calls] == ["run", "run", "fail"]
    assert all(end >= start for _, start, end in calls)
    assert "run" not in w.__dict__ and mod.fail is fail


def test_idle_time_goes_to_the_innermost_range_under_way() -> None:
    ranges = sorted([(0, 100, "launch"), (20, 40, "read"), (60, 70, "propose")])
    # a gap from 10 to 90: launch's own 10-20, read 20-40, launch 40-60, propose 60-70,
    # launch 70-90
    got: dict[str, float] = {}
    for label, us in _split(ranges, 10, 90):
        got[label] = got.get(label, 0) + us
    assert got == {"launch": 50, "read": 20, "propose": 10}
    # outside every range
    assert _split(ranges, 120, 130) == [("(unannotated)", 10)]


def test_device_timeline_without_device_events_gives_the_wall_alone() -> None:
    with profile() as prof:
        with torch.profiler.record_function("call"):
            torch.ones(4).sum()
    got = timeline.device_timeline(prof.events(), "call")
    assert set(got) == {"wall_ms"} and got["wall_ms"] > 0
