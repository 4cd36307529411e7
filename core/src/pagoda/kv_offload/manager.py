"""The scheduler's side of KV offload: which block hash sits in which CPU pool slot, which
copies are in flight, and which requests wait for a load.

No torch here: the manager decides, the workers copy (``pagoda.kv_offload.medium``). Each step
the manager's decisions leave as one :class:`KVTransfers` job in the scheduler output; the
job's id comes back in a runner output once its copies are done.

Life of a CPU slot::

    free --store queued--> storing --job done--> ready --evicted by the policy--> free
                                                   |  ^
                                      load queued  v  |  job done (unpinned)
                                                 pinned

Only a ready slot that no load pins may be evicted; only a ready slot serves a lookup.

A request whose prompt hits the CPU pool past its device hit holds device blocks for its whole
prompt at once and waits (``loading``) until its load job is done; then the loaded tokens count
as computed and it is ``ready`` to be scheduled, ahead of the waiting queue, needing no block.

With ``overlap`` (``cache.offload_overlap``) a long hit is met from both ends instead, as in
Cake ("Compute or Load KV Cache? Why Not Both?", Jin et al., 2024): the request runs at once,
its hit's last blocks load in one job from the start, and meanwhile the device computes its
first blocks, a chunk a step; neither touches the other's blocks. Where they meet, once the
load is done, the loaded blocks count as computed::

    device hit | computed, chunk by chunk -> | loaded, one job, from step one | suffix
    0        start                         low                             end

The bus and the device work at once, so a hit costs about what the slower of the two takes for
its share rather than the whole load. The computed share (``overlap_share``) is learned: each
hit ends with one side waiting for the other (the device for the load, or the load done while
the device still computes), and the share moves to balance the next hit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagoda.kv_offload.policy import OffloadPolicy
from pagoda.request import Request
from pagoda.step import KVTransfers


class DeviceBlock(Protocol):
    """A block of the device KV cache, as offload reads it (``kv_cache.block_pool``)."""

    @property
    def block_id(self) -> int: ...

    @property
    def block_hash(self) -> bytes | None: ...


class BlockSource(Protocol):
    """What offload needs of the device KV cache manager (``kv_cache.manager``): slots for a
    request whose prompt loads from the pool, and the blocks each request holds."""

    @property
    def req_to_blocks(self) -> Mapping[str, Sequence[DeviceBlock]]: ...

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[DeviceBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> Sequence[DeviceBlock] | None: ...


@dataclass
class OffloadStats:
    """Counted as things happen; ``make_stats`` hands them out per interval."""

    stored_blocks: int = 0  # blocks copied to the CPU pool
    loaded_blocks: int = 0  # blocks copied back to the device
    cpu_hit_tokens: int = 0  # prompt tokens served by the CPU pool (past the device's hit)
    dropped_stores: int = 0  # stores skipped: no slot could be freed


@dataclass
class _Overlap:
    """A request whose pool hit, blocks ``[start, end)``, is met from both ends: computed from
    ``start`` up to ``low``, loaded from ``low`` to ``end``. Every slot of the hit is pinned
    until it is loaded or the device has computed its block."""

    req: Request
    start: int
    end: int
    low: int
    slots: list[int]  # the pool slot of each block of the hit
    in_flight: dict[int, int] = field(default_factory=dict)  # load job id -> its blocks
    # Times (perf_counter) of each chunk granted, of the first step after the last, of the
    # load's end as reported, and of the first step with nothing left to compute while the
    # load was in flight.
    chunks: list[float] = field(default_factory=list)
    after: float | None = None
    loaded_at: float | None = None
    waited_at: float | None = None


@dataclass
class _Job:
    loads: list[int] = field(default_factory=list)  # CPU slots pinned by its loads
    load_gpu: list[int] = field(default_factory=list)  # device blocks they fill
    stores: list[int] = field(default_factory=list)  # CPU slots it fills
    store_gpu: list[int] = field(default_factory=list)  # device blocks its stores read
    req_ids: list[str] = field(default_factory=list)  # requests waiting for its loads


class OffloadManager:
    def __init__(
        self,
        num_cpu_blocks: int,
        block_size: int,
        policy: OffloadPolicy,
        store_full: bool = False,
        overlap: bool = False,
    ) -> None:
        if num_cpu_blocks < 1:
            raise ValueError(f"num_cpu_blocks={num_cpu_blocks}: the CPU pool needs a block")
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.policy = policy
        self.store_full = store_full
        self._free_slots = list(range(num_cpu_blocks - 1, -1, -1))
        self.hash_to_slot: dict[bytes, int] = {}
        self._pins: dict[int, int] = {}  # slot -> loads in flight reading it
        self._storing: set[int] = set()  # slots whose store is in flight
        self._gpu_storing: dict[int, int] = {}  # device block -> job storing it (full mode)
        self._jobs: dict[int, _Job] = {}  # launched, not done
        self._next_job = 0
        self._queued = _Job()  # the job being built by this schedule()
        self._stores_first = False
        self._wait_jobs: set[int] = set()
        # Load jobs done (on the rank that reports): every rank's forward must follow them
        # before it reads their blocks; sent once, since a stream's waits hold for what follows.
        self._loads_done: set[int] = set()
        # req_id -> (request, its job, tokens it loads)
        self.loading: dict[str, tuple[Request, int, int]] = {}
        self.ready: list[Request] = []
        self.stats = OffloadStats()
        self.stats_total = OffloadStats()
        # Overlap mode: blocks computed a step, and the share of a hit computed rather than
        # loaded (learned from each hit's end), for each request met from both ends.
        self.overlap = overlap
        self.overlap_chunk = 64
        self.overlap_share = 0.3
        self._step_s: float | None = None  # a computing step's seconds, as last measured
        self.overlaps: dict[str, _Overlap] = {}

    # ---- figures ---------------------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        return len(self.hash_to_slot)

    @property
    def usage(self) -> float:
        """Fraction of the CPU pool holding blocks (0.0 to 1.0)."""
        return self.num_used / self.num_cpu_blocks

    @property
    def num_waiting(self) -> int:
        """Requests loading or loaded and not yet scheduled."""
        return len(self.loading) + len(self.ready)

    @property
    def busy(self) -> bool:
        """Whether copies are queued or in flight, or requests wait for them."""
        q = self._queued
        waits = self._wait_jobs or self._loads_done
        return bool(self._jobs or q.loads or q.stores or waits or self.num_waiting)

    def idle_figures(self) -> dict[str, int]:
        """What must be zero once no request runs: pins, copies in flight, waiting requests."""
        return {
            "pinned_slots": sum(1 for n in self._pins.values() if n),
            "storing_slots": len(self._storing),
            "jobs_in_flight": len(self._jobs),
            "requests_loading": len(self.loading) + len(self.ready) + len(self.overlaps),
        }

    def make_stats(self) -> OffloadStats:
        """The stats gathered since the last call, then reset."""
        stats, self.stats = self.stats, OffloadStats()
        return stats

    # ---- lookups and loads -----------------------------------------------------------------------

    def num_hits(self, hashes: Sequence[bytes], start: int, stop: int) -> int:
        """How many of ``hashes[start:stop]``, from ``start`` on, are ready in the pool."""
        n = 0
        for h in hashes[start:stop]:
            slot = self.hash_to_slot.get(h)
            if slot is None or slot in self._storing:
                break
            n += 1
        return n

    def try_load(
        self,
        req: Request,
        kv: BlockSource,
        hit_blocks: Sequence[DeviceBlock],
        num_hit: int,
    ) -> bool:
        """If the request's prompt hits the pool past its device hit (``hit_blocks``), give it
        device blocks for its whole prompt, queue the load and park it in ``loading``; say
        whether it did. Not enough free device blocks: False, nothing changed."""
        if req.sampling_params.prompt_logprobs is not None:
            return False  # its prompt is computed whole, as for the device's prefix cache
        hashes = req.block_hashes
        max_hit = (req.num_tokens - 1) // self.block_size
        first = len(hit_blocks)
        n = self.num_hits(hashes, first, max_hit)
        if n == 0:
            return False
        slots = self._pin_hit(hashes[first : first + n])
        if kv.allocate_slots(req, req.num_tokens - num_hit, hit_blocks, num_hit) is None:
            self._unpin(slots)
            return False
        held = kv.req_to_blocks[req.request_id]
        job = self._queued
        job.loads.extend(slots)
        job.load_gpu.extend(b.block_id for b in held[first : first + n])
        job.req_ids.append(req.request_id)
        loaded = n * self.block_size
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit + loaded
        self.loading[req.request_id] = (req, self._next_job, loaded)
        for s in (self.stats, self.stats_total):
            s.loaded_blocks += n
            s.cpu_hit_tokens += loaded
        return True

    # ---- overlap: computed from the start, loaded from the end --------------------------------

    def try_overlap(
        self,
        req: Request,
        kv: BlockSource,
        hit_blocks: Sequence[DeviceBlock],
        num_hit: int,
    ) -> bool:
        """Overlap mode: if the prompt hits the pool past its device hit (``hit_blocks``) by
        more than two compute chunks, give it device blocks for its whole prompt, pin the hit's
        slots and say True: the caller runs it at once, computing no further than
        ``compute_limit``. Otherwise False, nothing changed."""
        if not self.overlap or req.sampling_params.prompt_logprobs is not None:
            return False
        hashes = req.block_hashes
        first = len(hit_blocks)
        n = self.num_hits(hashes, first, (req.num_tokens - 1) // self.block_size)
        if n <= 2 * self.overlap_chunk:
            return False
        slots = self._pin_hit(hashes[first : first + n])
        if kv.allocate_slots(req, req.num_tokens - num_hit, hit_blocks, num_hit) is None:
            self._unpin(slots)
            return False
        low = first + max(self.overlap_chunk, round(self.overlap_share * n))
        ov = _Overlap(req, first, first + n, low, slots)
        self.overlaps[req.request_id] = ov
        if low < ov.end:
            held = kv.req_to_blocks[req.request_id]
            self._queued.loads.extend(slots[low - first :])
            self._queued.load_gpu.extend(b.block_id for b in held[low : ov.end])
            ov.in_flight[self._next_job] = ov.end - low
            for s in (self.stats, self.stats_total):
                s.loaded_blocks += ov.end - low
                s.cpu_hit_tokens += (ov.end - low) * self.block_size
        return True

    def compute_limit(self, req: Request, known: int) -> int:
        """How many of ``req``'s ``known`` tokens may be computed by the end of this step: for
        a request met from both ends, one chunk more, and never into blocks queued for loading.
        Where the two meet and every load is done, the loaded blocks count as computed (here)
        and the request goes on as any other."""
        ov = self.overlaps.get(req.request_id)
        if ov is None:
            return known
        bs = self.block_size
        now = time.perf_counter()
        if req.num_computed_tokens < ov.low * bs:
            ov.chunks.append(now)
            return min(known, ov.low * bs, req.num_computed_tokens + self.overlap_chunk * bs)
        if ov.after is None:
            ov.after = now
        if ov.in_flight:
            if ov.waited_at is None:
                ov.waited_at = now
            return req.num_computed_tokens  # met: the load is still on its way
        self._learn(ov, now)
        self._end_overlap(ov)
        loaded = (ov.end - ov.low) * bs
        req.num_computed_tokens += loaded
        req.num_cached_tokens = max(req.num_cached_tokens, 0) + loaded
        return known

    def _learn(self, ov: _Overlap, now: float) -> None:
        """Move the computed share toward balance: by half the blocks the side that finished
        first could have taken over meanwhile, in computing steps (a chunk each)."""
        if len(ov.chunks) >= 2:
            self._step_s = (ov.chunks[-1] - ov.chunks[0]) / (len(ov.chunks) - 1)
        elif self._step_s is None and ov.chunks and ov.after is not None:
            self._step_s = ov.after - ov.chunks[0]  # one step: less sure, but a start
        if not self._step_s:
            return
        if ov.waited_at is not None:  # the device waited for the load
            # NOTE: from the step after the last chunk's was scheduled, which ran that chunk.
            steps = max((now - ov.waited_at) / self._step_s - 1, 0.0)
        elif ov.loaded_at is not None:  # the load was done while the device computed
            steps = -(now - ov.loaded_at) / self._step_s
        else:
            return
        share = self.overlap_share + 0.5 * steps * self.overlap_chunk / (ov.end - ov.start)
        self.overlap_share = min(max(share, 0.0), 0.9)

    def _end_overlap(self, ov: _Overlap) -> None:
        """Forget the overlap and unpin the slots whose blocks the device computed (the loaded
        ones are unpinned by their jobs)."""
        del self.overlaps[ov.req.request_id]
        self._unpin(ov.slots[: ov.low - ov.start])

    def _pin_hit(self, hashes: Sequence[bytes]) -> list[int]:
        """Pin the slots of a hit and tell the policy, before the device allocates for it.
        NOTE: the allocation may evict device blocks whose stores need slots; pinned, the hit's
        own slots are never the ones given up for them."""
        slots = []
        for h in hashes:
            slot = self.hash_to_slot[h]
            self._pins[slot] = self._pins.get(slot, 0) + 1
            self.policy.touch(h)
            slots.append(slot)
        return slots

    def _unpin(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self._pins[slot] -= 1
            if not self._pins[slot]:
                del self._pins[slot]

    # ---- stores ----------------------------------------------------------------------------------

    def on_blocks_evicted(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """The device evicted these cached blocks for a new owner in the step being scheduled
        (the ``on_blocks_evicted`` seam's arguments). Evicted mode: store them first; full mode:
        they are stored already, or their store must finish before the step overwrites them."""
        for block_id, h in zip(block_ids, block_hashes):
            job = self._gpu_storing.pop(block_id, None)
            if job == self._next_job:
                self._stores_first = True
            elif job is not None:
                self._wait_jobs.add(job)
            if not self.store_full:
                if self._queue_store(block_id, h):
                    self._stores_first = True

    def on_blocks_cached(self, blocks: Sequence[DeviceBlock], hashes: Sequence[bytes]) -> None:
        """Full mode: blocks just entered the device's prefix cache (computed); store them."""
        for block, h in zip(blocks, hashes):
            if block.block_hash == h and self._queue_store(block.block_id, h):
                self._gpu_storing[block.block_id] = self._next_job

    def _queue_store(self, block_id: int, h: bytes) -> bool:
        if h in self.hash_to_slot:
            self.policy.touch(h)
            return False
        slot = self._take_slot()
        if slot is None:
            self.stats.dropped_stores += 1
            self.stats_total.dropped_stores += 1
            return False
        self.hash_to_slot[h] = slot
        self._storing.add(slot)
        self.policy.insert(h)
        self._queued.stores.append(slot)
        self._queued.store_gpu.append(block_id)
        for s in (self.stats, self.stats_total):
            s.stored_blocks += 1
        return True

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        victim = self.policy.evict(self._can_evict)
        if victim is None:
            return None
        return self.hash_to_slot.pop(victim)  # type: ignore[arg-type]

    def _can_evict(self, h: object) -> bool:
        slot = self.hash_to_slot[h]  # type: ignore[index]
        return not self._pins.get(slot) and slot not in self._storing

    # ---- steps -----------------------------------------------------------------------------------

    def build_step(self) -> KVTransfers | None:
        """The copies and waits this schedule() decided, as the step's job; None when there
        is nothing to copy, wait for or poll."""
        q = self._queued
        out = KVTransfers(
            store_gpu=list(q.store_gpu),
            store_cpu=list(q.stores),
            load_cpu=list(q.loads),
            load_gpu=list(q.load_gpu),
            stores_first=self._stores_first,
            wait_jobs=sorted({j for j in self._wait_jobs if j in self._jobs} | self._loads_done),
        )
        if out.has_copies:
            out.job_id = self._next_job
            self._jobs[self._next_job] = q
            self._next_job += 1
            self._queued = _Job()
        self._stores_first = False
        self._wait_jobs = set()
        self._loads_done = set()
        if not out.has_copies and not out.wait_jobs and not self._jobs:
            return None
        return out

    def finish_jobs(self, job_ids: Sequence[int]) -> list[Request]:
        """Jobs whose copies are done: stored slots serve lookups, loads unpin their slots, and
        their requests' loaded tokens count as computed. Returns the requests now ready."""
        now_ready = []
        for job_id in job_ids:
            job = self._jobs.pop(job_id, None)
            if job is None:
                continue
            if job.loads:
                self._loads_done.add(job_id)
            self._unpin(job.loads)
            self._storing.difference_update(job.stores)
            for block_id in job.store_gpu:
                if self._gpu_storing.get(block_id) == job_id:
                    del self._gpu_storing[block_id]
            for ov in self.overlaps.values():
                if ov.in_flight.pop(job_id, None) is not None and not ov.in_flight:
                    ov.loaded_at = time.perf_counter()
            for req_id in job.req_ids:
                entry = self.loading.get(req_id)
                if entry is None or entry[1] != job_id:
                    continue  # aborted or preempted while loading
                req, _, loaded = self.loading.pop(req_id)
                req.num_computed_tokens += loaded
                self.ready.append(req)
                now_ready.append(req)
        return now_ready

    def drop(self, req: Request) -> bool:
        """Forget a request that ends (or is preempted) while loading, loaded or met from both
        ends; say whether it was one. Its device blocks are freed by the caller: a load still
        in flight into them makes the step that reuses them wait for it."""
        ov = self.overlaps.get(req.request_id)
        if ov is not None:  # its blocks go back while loads may still fill some of them
            self._wait_jobs.update(ov.in_flight)
            self._end_overlap(ov)
            return True
        entry = self.loading.pop(req.request_id, None)
        if entry is not None:
            # NOTE: loads are launched with the schedule() that queued them, and requests end
            # between schedule() calls, so the job is launched (or done) by now.
            self._wait_jobs.add(entry[1])
            return True
        if req in self.ready:
            self.ready.remove(req)
            return True
        return False

    def reset(self) -> None:
        """Forget every block no copy uses (``reset_prefix_cache``)."""
        for h, slot in list(self.hash_to_slot.items()):
            if self._can_evict(h):
                del self.hash_to_slot[h]
                self.policy.remove(h)
                self._free_slots.append(slot)
