"""A consistency check of the KV cache's bookkeeping that any test can call after any step.

``check_kv_cache(manager, scheduler)`` raises ``AssertionError`` naming the first broken rule:

- the free queue is a well-linked list of distinct blocks, exactly those with no reference, and
  its count is right; the null block (0) is never free, never held;
- each block's ``ref_cnt`` equals the number of requests holding it; no request holds a block
  twice;
- the prefix-cache index and the blocks' hashes agree both ways, and a request's cached leading
  blocks carry that request's own block hashes (so a hit returns the right KV);
- with a scheduler: only running requests hold blocks, enough for their computed tokens and no
  more than ``max_model_len`` needs.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def _fail(message: str) -> None:
    raise AssertionError(f"KV cache inconsistent: {message}")


def check_kv_cache(manager: Any, scheduler: Any = None) -> None:
    """Check ``manager`` (a ``KVCacheManager``) and, if given, ``scheduler``'s use of it."""
    pool = manager.block_pool
    queue = pool.free_block_queue
    free: list[Any] = []
    prev = queue._head
    block = prev.next_free_block
    while block is not queue._tail:
        if block is None or block.prev_free_block is not prev:
            _fail(f"free queue links broken after block {prev.block_id}")
        free.append(block)
        if len(free) > pool.num_blocks:
            _fail("free queue has a cycle")
        prev, block = block, block.next_free_block
    if queue._tail.prev_free_block is not prev:
        _fail("free queue tail link broken")
    if len(free) != queue.num_free_blocks:
        _fail(f"free queue holds {len(free)} blocks, counts {queue.num_free_blocks}")
    free_ids = [b.block_id for b in free]
    if len(set(free_ids)) != len(free_ids):
        _fail(f"a block is in the free queue twice: {free_ids}")
    if 0 in free_ids:
        _fail("the null block is in the free queue")

    holders: Counter[int] = Counter()
    for rid, blocks in manager.req_to_blocks.items():
        ids = [b.block_id for b in blocks]
        if len(set(ids)) != len(ids):
            _fail(f"request {rid} holds a block twice: {ids}")
        if 0 in ids:
            _fail(f"request {rid} holds the null block")
        holders.update(ids)
    for b in pool.blocks[1:]:
        if b.ref_cnt != holders[b.block_id]:
            _fail(f"block {b.block_id}: ref_cnt {b.ref_cnt}, held by {holders[b.block_id]}")
        in_queue = b.prev_free_block is not None
        if in_queue != (b.ref_cnt == 0):
            _fail(f"block {b.block_id}: ref_cnt {b.ref_cnt} but in free queue: {in_queue}")

    index = pool.cached_block_hash_to_block
    for h, b in index.items():
        if b.block_hash != h:
            _fail(f"index maps a hash to block {b.block_id}, which has another hash")
    for b in pool.blocks:
        if b.block_hash is not None and index.get(b.block_hash) is not b:
            _fail(f"block {b.block_id} has a hash the index does not map to it")
    for rid, n in manager.num_cached_blocks.items():
        blocks = manager.req_to_blocks.get(rid)
        held = None if blocks is None else len(blocks)
        if held is None or n > held:
            _fail(f"request {rid}: {n} blocks offered to the cache, holds {held}")

    if scheduler is None:
        return
    bs = manager.block_size
    for rid, blocks in manager.req_to_blocks.items():
        req = scheduler.requests.get(rid)
        if req is None or req.status.name != "RUNNING":
            _fail(f"request {rid} holds blocks but is {getattr(req, 'status', 'gone')}")
        if len(blocks) * bs < req.num_computed_tokens:
            _fail(f"request {rid}: {len(blocks)} blocks for {req.num_computed_tokens} tokens")
        if len(blocks) > manager.max_num_blocks_per_req:
            _fail(f"request {rid} holds {len(blocks)} blocks, more than max_model_len needs")
        for i in range(manager.num_cached_blocks.get(rid, 0)):
            h = blocks[i].block_hash
            if h is not None and i < len(req.block_hashes) and h != req.block_hashes[i]:
                _fail(f"request {rid}: block {i} is cached under another request's content")
