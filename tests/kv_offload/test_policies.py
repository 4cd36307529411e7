"""The CPU pool's eviction policies on known access traces: LRU and ARC differ where a block hit
twice meets a stream of blocks seen once, and ARC's target for T1 follows its ghosts."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest

from pagoda.kv_offload import LRUPolicy, OffloadPolicy, build_policy
from pagoda.kv_offload.arc import ARCPolicy


def play(policy: OffloadPolicy, trace: Sequence[Hashable]) -> list[bool]:
    """A pool of ``policy.capacity`` blocks: a hit touches, a miss stores (evicting first when
    full). Returns hit or miss for each access."""
    hits = []
    for key in trace:
        if key in policy:
            policy.touch(key)
            hits.append(True)
            continue
        if len(policy) >= policy.capacity:
            assert policy.evict(lambda k: True) is not None
        policy.insert(key)
        hits.append(False)
        assert len(policy) <= policy.capacity
    return hits


# A is used twice, then B and C pass by once each, then A comes back.
TRACE = ["A", "A", "B", "C", "A"]


def test_lru_drops_the_least_recently_used_block_even_if_it_was_hit_before() -> None:
    assert play(LRUPolicy(2), TRACE) == [False, True, False, False, False]


def test_arc_keeps_the_block_hit_twice_through_a_one_off_scan() -> None:
    policy = ARCPolicy(2)
    assert play(policy, TRACE) == [False, True, False, False, True]
    assert list(policy.t2) == ["A"] and "B" in policy.b1


def test_arc_grows_its_recency_target_when_a_ghost_of_t1_comes_back() -> None:
    policy = ARCPolicy(2)
    play(policy, ["A", "A", "B", "C"])  # B dropped from T1 into its ghost list B1
    assert policy.p == 0
    play(policy, ["B"])  # a miss, but a B1 ghost: T1 was too small
    assert policy.p == 1 and "B" in policy.t2


def test_lru_and_arc_differ_on_a_scan_that_lru_serves_better() -> None:
    # ARC protects X (hit twice) and so loses the recent Y; LRU keeps Y.
    trace = ["X", "X", "Y", "Z", "Y"]
    assert play(LRUPolicy(2), trace)[-1] is True
    assert play(ARCPolicy(2), trace)[-1] is False


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_a_policy_skips_blocks_it_may_not_evict(name: str) -> None:
    policy = build_policy(name, 3)
    for key in "abc":
        policy.insert(key)
    assert policy.evict(lambda k: k == "b") == "b"
    assert policy.evict(lambda k: False) is None
    assert len(policy) == 2 and "a" in policy and "c" in policy


def test_a_third_party_policy_registers_by_name_and_unknown_names_list_the_known() -> None:
    from pagoda import hookimpl
    from pagoda.plugins import plugin_registered

    class FIFO(LRUPolicy):
        def touch(self, key: Hashable) -> None:
            pass  # first in, first out: hits do not reorder

    class Plugin:
        PAGODA_PLUGIN_API = 1

        @hookimpl
        def register_offload_policies(self, register):
            register("fifo", FIFO)

    with plugin_registered(Plugin(), "fifo-policy"):
        assert play(build_policy("fifo", 2), TRACE) == [False, True, False, False, False]
    with pytest.raises(ValueError, match=r"cache\.offload_policy='fifo'.*available: arc, lru"):
        build_policy("fifo", 2)
