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
    offload.overlap_chunk = 0  # any hit is met from both ends
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
    if mode == "overlap":
        offload.top_up(kv)
    step = offload.build_step()
    assert sorted(step.load_cpu) == [0, 1] and not step.store_gpu
