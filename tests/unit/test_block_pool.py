from __future__ import annotations

import pytest

from pagoda.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def _links(blocks: list[KVCacheBlock]) -> list[tuple[object, object]]:
    return [(b.prev_free_block, b.next_free_block) for b in blocks]


def test_free_queue_remove_from_middle_touches_only_neighbours_and_keeps_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    before = _links(blocks)

    queue.remove(blocks[3])

    after = _links(blocks)
    changed = [i for i in range(6) if before[i] != after[i]]
    assert changed == [2, 3, 4]  # O(1): only the removed block and its two neighbours
    assert _ids(queue.get_all_free_blocks()) == [0, 1, 2, 4, 5]
    assert queue.num_free_blocks == 5


def test_free_queue_pops_front_and_appends_back() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks)

    first = queue.popleft()
    queue.append(first)
    queue.remove(blocks[2])
    queue.append_n([blocks[2]])

    assert _ids(queue.get_all_free_blocks()) == [1, 3, 0, 2]
    popped = queue.popleft_n(3)
    assert _ids(popped) == [1, 3, 0]
    assert queue.num_free_blocks == 1
    # Popped blocks leave the list whole: unlinked, and the rest still linked both ways.
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    queue.append_n(popped)
    assert _ids(queue.get_all_free_blocks()) == [2, 1, 3, 0]
    queue.remove(blocks[2])
    assert _ids(queue.popleft_n(2)) == [1, 3] and _ids(queue.get_all_free_blocks()) == [0]


def test_free_queue_rejects_popping_more_than_free_and_double_membership() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="asked for 3"):
        queue.popleft_n(3)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    queue.popleft_n(2)
    with pytest.raises(ValueError, match="no free"):
        queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])


def test_block_zero_is_reserved_and_never_handed_out() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(_ids(blocks)) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert pool.get_usage() == 1.0


def test_freed_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(num_blocks=7, enable_caching=True)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, [b"a0", b"a1", b"a2"], 0, 3)
    pool.cache_full_blocks(b, [b"b0", b"b1", b"b2"], 0, 3)
    pool.free_blocks(reversed(a))  # a sequence is freed tail first
    pool.free_blocks(reversed(b))

    evicted = pool.get_new_blocks(4)

    assert evicted == [a[2], a[1], a[0], b[2]]
    assert pool.get_cached_block(b"a0") is None
    assert pool.get_cached_block(b"b2") is None
    assert pool.get_cached_block(b"b1") is b[1]
    assert all(blk.block_hash is None for blk in evicted)


def test_touch_takes_a_free_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"x", b"y"], 0, 1)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 3

    hit = pool.get_cached_block(b"x")
    assert hit is blocks[0]
    pool.touch([hit])

    assert hit.ref_cnt == 1
    assert pool.get_num_free_blocks() == 2
    assert hit not in pool.get_new_blocks(2)
    assert pool.get_cached_block(b"x") is hit  # still cached while in use


def test_touch_of_a_shared_block_in_use_only_adds_a_reference() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 1
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 2


def test_cache_full_blocks_leaves_a_duplicate_of_cached_content_uncached() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    first = pool.get_new_blocks(2)
    second = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, [b"p", b"q"], 0, 2)
    pool.cache_full_blocks(second, [b"p", b"r"], 0, 2)

    assert second[0].block_hash is None
    assert pool.get_cached_block(b"p") is first[0]
    assert pool.get_cached_block(b"r") is second[1]
    pool.free_blocks(second)
    pool.free_blocks(first)
    assert pool.get_num_free_blocks() == 4


def test_cache_full_blocks_is_a_no_op_without_prefix_caching() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"h"], 0, 1)
    assert pool.get_cached_block(b"h") is None


def test_freeing_more_often_than_taken_raises() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks(blocks)


def test_reset_prefix_cache_forgets_every_hash() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"u", b"v"], 0, 2)
    pool.free_blocks(blocks[:1])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(b"u") is None
    assert pool.get_cached_block(b"v") is None
    assert all(b.block_hash is None for b in blocks)


def test_pool_needs_a_usable_block_besides_the_null_block() -> None:
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockPool(num_blocks=1)


def test_a_block_freed_too_often_stops_free_blocks_with_the_queue_whole() -> None:
    """``free_blocks`` links a run of blocks at once: the blocks before a bad one stay freed,
    the bad one raises naming it, and the queue is a whole list after (counted and linked)."""
    pool = BlockPool(num_blocks=6, enable_caching=True)
    a = pool.get_new_blocks(3)
    free_before = pool.get_num_free_blocks()
    a[1].ref_cnt = 0  # (freed already, by a bug)
    with pytest.raises(ValueError, match=f"block {a[1].block_id} freed more often"):
        pool.free_blocks(a)
    assert pool.get_num_free_blocks() == free_before + 1  # a[0] went back
    queue = pool.free_block_queue.get_all_free_blocks()
    assert queue[-1] is a[0] and len(queue) == pool.get_num_free_blocks()
    assert pool.free_block_queue._tail.prev_free_block is a[0]
    with pytest.raises(ValueError, match=f"block {a[0].block_id} freed more often"):
        pool.free_blocks([a[0]])
    a[1].ref_cnt = 1
    pool.free_blocks([a[2], a[1]])  # the rest, in the order given: evicted in that order
    assert pool.free_block_queue.get_all_free_blocks()[-3:] == [a[0], a[2], a[1]]
    assert pool.get_new_blocks(pool.get_num_free_blocks())[-3:] == [a[0], a[2], a[1]]


def test_a_block_in_the_free_queue_with_references_again_is_not_linked_twice() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    block.ref_cnt = 1  # (a reference taken without leaving the queue: a bug)
    with pytest.raises(ValueError, match="already in the free queue"):
        pool.free_blocks([block])
    assert len(pool.free_block_queue.get_all_free_blocks()) == pool.get_num_free_blocks() == 2
