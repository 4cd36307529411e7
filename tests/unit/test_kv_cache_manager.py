from __future__ import annotations

import pytest

from pagoda.kv_cache.hashing import hash_block_tokens, update_block_hashes
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int], salt: str | None = None, **sp: object) -> Request:
    return Request(rid, list(tokens), SamplingParams(**sp), cache_salt=salt)  # type: ignore[arg-type]


def _run(manager: KVCacheManager, req: Request) -> None:
    """Admit ``req`` with its prefix-cache hit and compute all its tokens, as a step would."""
    hit_blocks, num_hit = manager.get_computed_blocks(req)
    n = req.num_tokens - num_hit
    assert manager.allocate_slots(req, n, hit_blocks, num_hit) is not None
    req.num_computed_tokens = num_hit + n


def test_block_hash_depends_on_parent_tokens_and_extra_keys() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4]) == base
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(b"parent", [1, 2, 3, 4]) != base
    assert hash_block_tokens(b"other", [1, 2, 3, 4]) != hash_block_tokens(b"parent", [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != hash_block_tokens(
        None, [1, 2, 3, 4], ("b",)
    )


def test_equal_blocks_after_different_prefixes_hash_differently() -> None:
    a = _req("a", [1, 1, 1, 1, 9, 9, 9, 9])
    b = _req("b", [2, 2, 2, 2, 9, 9, 9, 9])
    ha, hb = update_block_hashes(a, BS), update_block_hashes(b, BS)
    assert ha[1] != hb[1]
    assert ha[1] == hash_block_tokens(ha[0], [9, 9, 9, 9])


def test_cache_salt_folds_into_the_first_block_and_changes_the_whole_chain() -> None:
    tokens = list(range(8))
    plain = update_block_hashes(_req("a", tokens), BS)
    salted = update_block_hashes(_req("b", tokens, salt="tenant-1"), BS)
    other = update_block_hashes(_req("c", tokens, salt="tenant-2"), BS)
    assert salted[0] == hash_block_tokens(None, tokens[:4], ("tenant-1",))
    assert salted[1] == hash_block_tokens(salted[0], tokens[4:])  # no salt after block 0
    assert all(p != s != o for p, s, o in zip(plain, salted, other))


def test_block_hashes_cover_only_full_blocks_and_extend_with_output_tokens() -> None:
    req = _req("a", list(range(7)))
    assert len(update_block_hashes(req, BS)) == 1
    first = req.block_hashes[0]
    req.output_token_ids.append(100)
    assert len(update_block_hashes(req, BS)) == 2
    assert req.block_hashes[0] == first
    assert req.block_hashes[1] == hash_block_tokens(first, [4, 5, 6, 100])


def test_second_request_hits_the_full_blocks_of_a_finished_one() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    a = _req("a", list(range(10)))
    _run(manager, a)
    manager.free(a)

    b = _req("b", list(range(9)) + [77, 78])
    blocks, num_hit = manager.get_computed_blocks(b)

    assert num_hit == 8
    assert [blk.block_id for blk in blocks] == _cached_block_ids(a, manager, 2)


def test_the_lookup_hashes_only_as_far_as_the_hit_and_the_rest_waits_for_hash_blocks() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    a = _req("a", list(range(10)))
    _run(manager, a)
    manager.free(a)

    new = _req("new", [50 + t for t in range(13)])  # its first block misses
    assert manager.get_computed_blocks(new) == ([], 0)
    assert len(new.block_hashes) == 1
    b = _req("b", list(range(8)) + [77, 78, 79, 80, 81])  # hits 2 blocks, misses the third
    _, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8 and len(b.block_hashes) == 3
    manager.hash_blocks(new)  # (the engine calls it once the step runs)
    assert new.block_hashes == update_block_hashes(_req("same", new.all_token_ids), BS)
    assert len(new.block_hashes) == 3


def _cached_block_ids(req: Request, manager: KVCacheManager, n: int) -> list[int]:
    ids = []
    for h in req.block_hashes[:n]:
        block = manager.block_pool.get_cached_block(h)
        assert block is not None
        ids.append(block.block_id)
    return ids


@pytest.mark.parametrize(("prompt_len", "expected_hit"), [(8, 4), (9, 8), (12, 8)])
def test_full_prompt_hit_still_leaves_the_last_token_to_compute(
    prompt_len: int, expected_hit: int
) -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    first = _req("a", list(range(prompt_len)), max_tokens=1)
    _run(manager, first)
    manager.free(first)

    again = _req("b", list(range(prompt_len)))
    _, num_hit = manager.get_computed_blocks(again)
    assert num_hit == expected_hit
    assert again.num_tokens - num_hit >= 1


def test_blocks_are_shared_only_after_the_step_that_computes_them() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    a = _req("a", list(range(9)))
    assert manager.allocate_slots(a, 9) is not None  # scheduled, not yet computed

    assert manager.get_computed_blocks(_req("b", list(range(9))))[1] == 0

    a.num_computed_tokens = 9  # the step ran
    a.output_token_ids.append(5)
    assert manager.allocate_slots(a, 1) == []  # next step: room left in the last block
    assert manager.get_computed_blocks(_req("c", list(range(9))))[1] == 8


def test_allocate_slots_returns_none_and_takes_nothing_when_blocks_run_short() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=12)
    a = _req("a", list(range(8)))
    assert len(manager.allocate_slots(a, 8) or []) == 2
    b = _req("b", list(range(50, 59)))
    assert manager.allocate_slots(b, 9) is None
    assert manager.num_free_blocks == 1
    assert manager.get_block_ids("b") == []


def test_free_cached_blocks_taken_by_a_hit_count_as_not_available() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS, max_model_len=20)
    a = _req("a", list(range(8)))
    _run(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 4

    b = _req("b", list(range(8)) + list(range(100, 108)))
    hit_blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    # 2 hit blocks (free now) + 2 new blocks fit in 4 free blocks; one more token would not.
    assert manager.allocate_slots(b, 9, hit_blocks, num_hit) is None
    new = manager.allocate_slots(b, 8, hit_blocks, num_hit)
    assert new is not None and len(new) == 2
    assert manager.num_free_blocks == 0
    assert manager.get_block_ids("b")[:2] == [blk.block_id for blk in hit_blocks]


def test_identical_prompts_computed_together_dedupe_without_error() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    a, b = _req("a", list(range(12))), _req("b", list(range(12)))
    for req in (a, b):
        assert manager.allocate_slots(req, 12) is not None
    for req in (a, b):
        req.num_computed_tokens = 12
        req.output_token_ids.append(1)
        assert manager.allocate_slots(req, 1) is not None
    assert len(manager.block_pool.cached_block_hash_to_block) == 3
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 19
    assert manager.get_computed_blocks(_req("c", list(range(13))))[1] == 12


def test_preempted_request_hits_its_own_blocks_including_output_tokens() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    req = _req("a", list(range(6)))
    _run(manager, req)
    for t in (40, 41, 42, 43):
        req.output_token_ids.append(t)
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    req.output_token_ids.append(44)  # sampled, not yet computed: 11 tokens, 10 computed
    manager.free(req)
    req.num_computed_tokens = 0

    _, num_hit = manager.get_computed_blocks(req)
    assert num_hit == 8


def test_free_is_idempotent_and_returns_every_block() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=36)
    a, b = _req("a", list(range(10))), _req("b", list(range(10)))
    _run(manager, a)
    _run(manager, b)
    manager.free(a)
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 9
    assert manager.usage == 0.0
    assert manager.get_block_ids("a") == []


def test_tail_blocks_of_a_freed_request_are_evicted_before_its_prefix() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=16)
    a = _req("a", list(range(12)))
    _run(manager, a)
    manager.free(a)

    other = _req("x", list(range(50, 54)))
    assert manager.allocate_slots(other, 4) is not None  # evicts one block: a's last

    _, num_hit = manager.get_computed_blocks(_req("b", list(range(12)) + [99]))
    assert num_hit == 8


def test_prefix_cache_stats_count_each_admission_once() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    a = _req("a", list(range(10)))
    manager.get_computed_blocks(a)  # a lookup alone is not an admission
    _run(manager, a)
    manager.free(a)
    _run(manager, _req("b", list(range(10))))

    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    assert manager.make_prefix_cache_stats().queries == 0


def test_prompt_logprobs_requests_skip_the_prefix_cache() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    a = _req("a", list(range(10)))
    _run(manager, a)
    manager.free(a)
    assert manager.get_computed_blocks(_req("b", list(range(10)), prompt_logprobs=1))[1] == 0


def test_reset_prefix_cache_forgets_hits_and_recaches_running_blocks() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    a = _req("a", list(range(10)))
    _run(manager, a)
    manager.free(a)
    running = _req("r", list(range(100, 110)))
    _run(manager, running)
    running.output_token_ids.append(3)
    manager.allocate_slots(running, 1)  # caches its 2 computed full blocks
    running.num_computed_tokens += 1
    manager.reset_prefix_cache()
    assert manager.get_computed_blocks(_req("b", list(range(10))))[1] == 0
    assert manager.get_computed_blocks(_req("c", list(range(100, 110))))[1] == 0

    running.output_token_ids.append(4)
    manager.allocate_slots(running, 1)
    assert manager.get_computed_blocks(_req("d", list(range(100, 110))))[1] == 8


def test_no_hits_with_prefix_caching_disabled() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=False, max_model_len=64)
    a = _req("a", list(range(10)))
    _run(manager, a)
    manager.free(a)
    assert manager.get_computed_blocks(_req("b", list(range(10)))) == ([], 0)
    assert manager.num_free_blocks == 19


def test_allocate_slots_rejects_tokens_beyond_max_model_len() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len=8"):
        manager.allocate_slots(_req("a", list(range(9))), 9)


def test_a_step_within_held_blocks_takes_none_and_still_offers_filled_blocks_to_the_cache() -> (
    None
):
    """Accepted drafts fill blocks the request reserved as lookahead: the next allocation needs
    no block (and takes none from the pool), yet the blocks now full and computed enter the
    prefix cache then, as they would with a block taken."""
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=64)
    req = _req("a", [1, 2, 3, 4, 5])
    _run(kv, req)  # 5 computed: blocks 0 (full) and 1
    assert kv.allocate_slots(req, 1, num_lookahead_tokens=6) is not None  # slots to 12: 3 blocks
    held, free = kv.get_block_ids("a"), kv.block_pool.get_num_free_blocks()
    req.output_token_ids += [6, 7, 8, 9, 10]
    req.num_computed_tokens = 10  # the step's token and 4 accepted drafts: block 1 full
    assert kv.allocate_slots(req, 1) == []
    assert kv.get_block_ids("a") == held and kv.block_pool.get_num_free_blocks() == free
    other = _req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    blocks, num_hit = kv.get_computed_blocks(other)
    assert num_hit == 2 * BS and [b.block_id for b in blocks] == held[:2]
