"""The offload manager against a real device block pool, no model: a hit's CPU slots are safe
from the stores that its own device allocation causes."""

from __future__ import annotations

import pytest

from pagoda.kv_cache.hashing import update_block_hashes
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.kv_offload import OffloadManager
from pagoda.kv_offload.policy import LRUPolicy
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


@pytest.mark.parametrize("mode", ["load", "overlap"])
def test_a_hit_keeps_its_slots_when_its_allocation_evicts_a_block_the_full_pool_must_store(
    mode: str,
) -> None:
    # A full pool of 2 slots holds a 2-block context; the device (3 usable blocks) holds one
    # other cached block. Admitting the context's next turn takes all 3 device blocks, evicting
    # that block: evicted mode stores it, and the pool's least recently used blocks are the
    # hit's own. They must stay: the store is dropped instead.
    offload = OffloadManager(2, BS, LRUPolicy(2), overlap=mode == "overlap")
    offload.overlap_chunk, offload.overlap_share = 0, 0.0  # any hit: every block loaded
    kv = KVCacheManager(4, BS, True, 64, offload)
    context = list(range(10, 18))
    turn = _req("turn", context + [99])
    hashes = update_block_hashes(turn, BS)[:2]
    for block_id, h in zip((1, 2), hashes):
        offload.on_blocks_evicted([block_id], [h])  # as when the device let them go
    offload.finish_jobs([offload.build_step().job_id])
    assert offload.num_used == 2 and offload.idle_figures()["storing_slots"] == 0
    other = _req("other", [50, 51, 52, 53])
    hit, n = kv.get_computed_blocks(other)
    kv.allocate_slots(other, 4, hit, n)
    other.num_computed_tokens = 4
    kv.free(other)  # cached on the device, free

    hit, n = kv.get_computed_blocks(turn)
    assert n == 0
    start = offload.try_overlap if mode == "overlap" else offload.try_load
    assert start(turn, kv, hit, n)
    assert [offload.hash_to_slot[h] for h in hashes] == [0, 1]
    assert offload.stats_total.dropped_stores == 1
    step = offload.build_step()
    assert sorted(step.load_cpu) == [0, 1] and not step.store_gpu


def test_overlap_computes_more_of_the_next_hit_after_the_device_waited_for_a_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter(range(100))
    monkeypatch.setattr("pagoda.kv_offload.manager.time.perf_counter", lambda: next(clock))
    offload = OffloadManager(16, BS, LRUPolicy(16), overlap=True)
    offload.overlap_chunk = 1
    kv = KVCacheManager(16, BS, True, 64, offload)
    turn = _req("turn", list(range(10, 50)) + [99])  # 10 full blocks, all in the pool
    hashes = update_block_hashes(turn, BS)[:10]
    offload.on_blocks_evicted(list(range(1, 11)), hashes)
    offload.finish_jobs([offload.build_step().job_id])
    assert offload.try_overlap(turn, kv, [], 0)  # share 0.3: blocks 0-2 computed, 3-9 loaded
    job = offload.build_step().job_id
    for _ in range(3):  # steps at t = 0, 1, 2 compute a block each
        turn.num_computed_tokens = offload.compute_limit(turn, turn.num_tokens)
    assert turn.num_computed_tokens == 3 * BS
    # t = 3: nothing left to compute, the load still in flight; reported done at t = 8.
    assert offload.compute_limit(turn, turn.num_tokens) == 3 * BS
    for _ in range(4):
        next(clock)
    offload.finish_jobs([job])
    assert offload.compute_limit(turn, turn.num_tokens) == turn.num_tokens  # t = 9: merged
    assert turn.num_computed_tokens == 10 * BS
    # Steps of 1 s; the device waited 9 - 3 - 1 (its last chunk) = 5 steps: half of 5 blocks
    # of the 10-block hit move to the device.
    assert offload.overlap_share == pytest.approx(0.3 + 0.5 * 5 / 10)
