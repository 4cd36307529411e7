"""The pool of KV cache blocks: a free queue in eviction order and the prefix-cache index.

A block with ``ref_cnt == 0`` sits in the free queue; if it still has a ``block_hash`` its
contents stay reusable by a prefix-cache hit until the block is popped for a new owner.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is in the prefix-cache index (full and computed).
    block_hash: bytes | None = None
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """A doubly linked list threaded through the blocks themselves.

    Popping from the front, appending at the back and removing from the middle are all O(1)
    and allocate nothing. The front holds the block to evict next.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free KV cache blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free KV cache blocks, {self.num_free_blocks} free")
        # NOTE: one walk down the list and one relink of its head, not n removals (a step of
        # long new prompts takes thousands of blocks before it starts).
        out = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            out.append(block)
            block = nxt
        assert block is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None  # the tail sentinel always has a predecessor
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from front (evicted first) to back; for tests and debugging."""
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """Owns every block: hands out free ones, counts references, indexes cached full blocks.

    NOTE: block 0 is reserved as the null block and is never handed out, so a model runner can
    pad block tables with 0. ``num_blocks - 1`` blocks are usable.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        # (block id, hash) of each cached block evicted, where a subclass wants them (None: not
        # kept)
        self.evicted: list[tuple[int, bytes]] | None = None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the front of the free queue, evicting their cached contents
        (recorded in ``evicted`` where it is a list)."""
        blocks = self.free_block_queue.popleft_n(n)
        # NOTE: one loop, no call a block: a step of new prompts takes thousands of blocks
        # before its first kernel, most of them cached once.
        index, log = self.cached_block_hash_to_block, self.evicted
        for block in blocks:
            h = block.block_hash
            if h is not None:
                block.block_hash = None
                if index.get(h) is block:
                    del index[h]
                if log is not None:
                    log.append((block.block_id, h))
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache, pulling free ones out of the
        free queue so they cannot be evicted while in use."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        A block whose content is already indexed under another block stays uncached: the two
        hold the same KV, and the one in the index keeps serving hits.
        """
        if not self.enable_caching:
            return
        index = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            h = block_hashes[i]
            if h not in index:
                block.block_hash = h
                index[h] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those left unused join the back of the free
        queue in the given order, so the first given is evicted first."""
        # NOTE: the queue's append inlined (a request's blocks at a time, thousands a step of
        # finished prompts, after the last step's kernels: the host's time then is the wall's).
        queue = self.free_block_queue
        tail = queue._tail
        last = tail.prev_free_block
        added = 0
        try:
            for block in ordered_blocks:
                n = block.ref_cnt - 1
                if n < 0:
                    raise ValueError(f"block {block.block_id} freed more often than taken")
                block.ref_cnt = n
                if n == 0:
                    if block.prev_free_block is not None:
                        raise ValueError(f"block {block.block_id} is already in the free queue")
                    last.next_free_block = block
                    block.prev_free_block = last
                    last = block
                    added += 1
        finally:  # (what was appended before a bad block stays appended, the queue whole)
            last.next_free_block = tail
            tail.prev_free_block = last
            queue.num_free_blocks += added

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 to 1.0)."""
        usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable

    def reset_prefix_cache(self) -> None:
        """Forget every cached block; blocks in use keep their contents but serve no hits."""
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
