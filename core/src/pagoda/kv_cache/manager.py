"""The KV cache manager: which blocks each request holds, and prefix-cache lookups.

NOTE: a block enters the prefix cache only once its KV has been computed in an earlier step
(its tokens are below ``request.num_computed_tokens`` when the manager looks). A block filled in
the current step is never shared within that step, so correctness does not depend on the order
in which an attention backend writes and reads the cache inside one forward pass, and a request
preempted before its step runs leaves no uncomputed block behind in the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagoda.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagoda.kv_cache.hashing import update_block_hashes
from pagoda.kv_offload.manager import OffloadManager
from pagoda.plugins.seams import seam
from pagoda.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counted once per admission (first or after preemption) of a request."""

    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        max_model_len: int | None = None,
        offload: OffloadManager | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be at least 1")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Plugin seam: None unless a plugin implements on_blocks_evicted.
        self._on_evicted = seam("on_blocks_evicted")
        # KV offload (pagoda.kv_offload): stores evicted (or every cached) block to a CPU pool.
        self.offload = offload
        self._evict_hooks = [
            h for h in (self._on_evicted, offload and offload.on_blocks_evicted) if h is not None
        ]
        pool_cls = _RecordingBlockPool if self._evict_hooks else BlockPool
        self.block_pool = pool_cls(num_blocks, enable_caching)
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len if max_model_len is not None else num_blocks * block_size
        self.max_num_blocks_per_req = cdiv(self.max_model_len, block_size)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request have been offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # First full blocks of pooling prompts not admitted to the prefix cache, most recent
        # last, at most one per block (``admits_pooled_prompt``).
        self._sightings: OrderedDict[bytes, None] = OrderedDict()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and how many tokens it covers.

        NOTE: the hit stops short of the last token even when everything is cached: the model
        must still run on that token to produce the logits for the next one.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if self.offload is not None:  # (its pool is looked up past the device's hit)
            update_block_hashes(request, self.block_size)
        # NOTE: hashed as far as the hit goes: a new prompt's first block misses, and the rest
        # of its hashes (sha256 a block: milliseconds for a step of long prompts, all before
        # the step starts) wait for ``hash_blocks``, once the step runs.
        hashes = request.block_hashes
        blocks: list[KVCacheBlock] = []
        for i in range(max_hit_blocks):
            if i == len(hashes):
                update_block_hashes(request, self.block_size, i + 1)
            block = self.block_pool.get_cached_block(hashes[i])
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def admits_pooled_prompt(self, request: Request) -> bool:
        """Whether a pooling prompt that one step computes whole (nothing of it cached) enters
        the prefix cache: only on the second sighting of its first full block. A first sighting
        is remembered (the most recent ``num_blocks`` of them) and its blocks are not kept, so
        its keys and values need not be stored at all (``Request.caches_prefix``): the common
        embedding load, every document new, stores nothing, while a prefix that recurs (an
        instruction before each query, a repeated input) is cached from its second request
        on and hit from its third. Generation requests are always kept (their own decode
        steps read their keys). A prompt without a full block has nothing to cache."""
        if not self.enable_caching or request.num_tokens < self.block_size:
            return False
        first = update_block_hashes(request, self.block_size, 1)[0]
        seen = self._sightings
        if first in seen:
            del seen[first]
            return True
        seen[first] = None
        if len(seen) > self.num_blocks:
            seen.popitem(last=False)
        return False

    def hash_blocks(self, request: Request) -> None:
        """Hash every full block of the request's tokens, for the prefix cache to file them
        under when they are computed: host work the engine does while a step runs (the lookup
        hashes only as far as the hit; ``_cache_computed_blocks`` hashes what is still missing
        itself)."""
        if self.enable_caching and request.caches_prefix:
            update_block_hashes(request, self.block_size)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give the request slots for ``num_new_tokens`` more tokens; None if blocks run short.

        Layout of the request's tokens::

            -----------------------------------------------------------------------
            | < computed > | < new computed > |    < new >    | < lookahead > |
            -----------------------------------------------------------------------
                           |   < to be computed this step >   |
            -----------------------------------------------------------------------
                           | < prefix-cache hit > |
            -----------------------------------------------------------------------
            | <            blocks the request holds after this call             > |

        computed: ``request.num_computed_tokens``, already in the request's blocks.
        new computed: ``num_new_computed_tokens``, the hit from ``get_computed_blocks``, held in
            ``new_computed_blocks``; taken over without computing.
        new: ``num_new_tokens``, to be computed this step.
        lookahead: ``num_lookahead_tokens`` more slots for speculative tokens.

        On None nothing has changed. Cached blocks with no other user count as not free here,
        since taking them removes them from the free queue. On success the request's full
        blocks already computed are added to the prefix cache.
        """
        if num_new_tokens < 1:
            raise ValueError(f"request {request.request_id}: num_new_tokens must be positive")
        req_id = request.request_id
        held = self.req_to_blocks.get(req_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        if num_computed + num_new_tokens > self.max_model_len:
            raise ValueError(
                f"request {req_id}: {num_computed + num_new_tokens} tokens exceed "
                f"max_model_len={self.max_model_len}"
            )
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = cdiv(num_slots, self.block_size) - len(held) - len(new_computed_blocks)
        if num_new_blocks <= 0 and not new_computed_blocks and request.num_computed_tokens:
            # A decoding request within the blocks it holds (most calls): nothing to take.
            self._cache_computed_blocks(request, num_computed)
            return []
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_evictable > self.block_pool.get_num_free_blocks():
            return None

        if request.num_computed_tokens == 0 and self.enable_caching:
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_new_computed_tokens
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        if self._evict_hooks:  # plugin seam, KV offload
            self.block_pool.report_evicted(self._evict_hooks)
        held = self.req_to_blocks.setdefault(req_id, held)
        held.extend(new_computed_blocks)
        held.extend(new_blocks)
        self._cache_computed_blocks(request, num_computed)
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Offer the request's computed full blocks to the prefix cache now (after its step ran),
        rather than at its next allocation."""
        if request.request_id in self.req_to_blocks:
            self._cache_computed_blocks(request, request.num_computed_tokens)

    def _cache_computed_blocks(self, request: Request, num_computed_tokens: int) -> None:
        if not self.enable_caching or not request.caches_prefix:
            return
        req_id = request.request_id
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        done = self.num_cached_blocks.get(req_id, 0)
        if num_full <= done:
            return
        hashes = update_block_hashes(request, self.block_size)
        blocks = self.req_to_blocks[req_id]
        self.block_pool.cache_full_blocks(blocks, hashes, done, num_full)
        self.num_cached_blocks[req_id] = num_full
        if self.offload is not None and self.offload.store_full:
            self.offload.on_blocks_cached(blocks[done:num_full], hashes[done:num_full])

    def free(self, request: Request) -> None:
        """Return every block the request holds; its computed full blocks stay in the prefix
        cache. The tail of the sequence is freed first, so it is evicted first. Idempotent."""
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            return
        self._cache_computed_blocks(request, request.num_computed_tokens)
        del self.req_to_blocks[req_id]
        self.num_cached_blocks.pop(req_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Return the request's blocks past the first ``num_tokens`` slots (speculative decoding:
        slots of rejected drafts). Such blocks hold no computed token, so none is in the prefix
        cache."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> None:
        """Forget all cached blocks. Blocks of running requests are offered to the cache again
        at their next allocation."""
        self.block_pool.reset_prefix_cache()
        self._sightings.clear()
        if self.offload is not None:
            self.offload.reset()
        for req_id in self.num_cached_blocks:
            self.num_cached_blocks[req_id] = 0

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats gathered since the last call (for per-step metrics), then reset."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats


class _RecordingBlockPool(BlockPool):
    """A block pool that remembers what it evicts, for the ``on_blocks_evicted`` seam; used
    only when a plugin implements that hook."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, enable_caching)
        self.evicted: list[tuple[int, bytes]] = []  # (get_new_blocks records into it)

    def report_evicted(self, hooks: Sequence[Callable[..., None]]) -> None:
        if self.evicted:
            evicted, self.evicted = self.evicted, []
            ids, hashes = [i for i, _ in evicted], [h for _, h in evicted]
            for hook in hooks:
                hook(block_ids=ids, block_hashes=hashes)
