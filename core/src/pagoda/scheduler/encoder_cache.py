"""The encoder cache's bookkeeping: which images' encoder outputs the runner holds, who still
needs them, and what to drop when room is needed. No torch: the runner holds the tensors and
drops those this manager evicts (``SchedulerOutput.free_encoder_ids``).

An image's output is referenced by each request whose placeholders for it are not all computed
yet; once the last reference goes it stays, reusable by a later request with the same image
(a hit), until the space is needed (least recently used first).
"""

from __future__ import annotations

from collections import OrderedDict

from pagoda.request import Request


class EncoderCacheManager:
    def __init__(self, capacity: int) -> None:
        """``capacity``: encoder output rows (image tokens) the runner may hold at once."""
        self.capacity = capacity
        self.sizes: dict[str, int] = {}  # identifier -> tokens, for every held output
        self.refs: dict[str, set[str]] = {}  # identifier -> requests that still need it
        self.idle: OrderedDict[str, None] = OrderedDict()  # unreferenced, oldest first
        self.used = 0
        self.freed: list[str] = []  # evicted since the last ``take_freed``
        self.queries = 0  # images looked up by a request scheduled for them
        self.hits = 0  # of those, found held (computed for another request, or earlier)

    def has(self, identifier: str) -> bool:
        return identifier in self.sizes

    def room_for(self, num_tokens: int, pending: int = 0) -> bool:
        """Whether ``num_tokens`` more fit beside ``pending`` tokens planned this step, once
        unreferenced outputs are evicted."""
        idle = sum(self.sizes[i] for i in self.idle)
        return self.used - idle + pending + num_tokens <= self.capacity

    def plan(
        self, request: Request, start: int, num_new: int, budget: int
    ) -> tuple[int, list[int]]:
        """How many of ``num_new`` prompt tokens from ``start`` the request may compute this
        step, and which of its images the encoder computes for them, within the step's encoder
        ``budget`` (tokens) and the cache's room. A chunk stops before an image that cannot be
        computed now; the images it covers in part stay held until their last placeholder."""
        end = start + num_new
        todo: list[int] = []
        pending = 0
        for i, f in enumerate(request.mm_inputs.features):
            if f.offset >= end:
                break
            if f.end <= start or self.has(f.identifier):
                continue
            if pending + f.length > budget or not self.room_for(f.length, pending):
                end = f.offset
                break
            todo.append(i)
            pending += f.length
        return max(end - start, 0), todo

    def commit(self, request: Request, start: int, num_new: int, todo: list[int]) -> int:
        """Reference the images that ``[start, start + num_new)`` meets and room for those the
        encoder computes (``todo``); returns the encoder tokens spent."""
        met = [(i, f) for i, f in enumerate(request.mm_inputs.features)
               if f.offset < start + num_new and f.end > start]  # fmt: skip
        # NOTE: held outputs are referenced first, so that making room for the new ones never
        # evicts one this chunk reads.
        for i, f in met:
            if i not in todo:
                self.reference(request, f.identifier, hit=True)
        for i, f in met:
            if i in todo:
                self.allocate(request, f.identifier, f.length)
        return sum(f.length for i, f in met if i in todo)

    def release_computed(self, request: Request) -> None:
        """Let go of the images whose placeholders are all computed."""
        for f in request.mm_inputs.features:
            if f.end <= request.num_computed_tokens:
                self.release(request, f.identifier)

    def reference(self, request: Request, identifier: str, hit: bool) -> None:
        """``request`` needs ``identifier``'s output (held, or computed this step)."""
        holders = self.refs.setdefault(identifier, set())
        if request.request_id in holders:
            return
        self.queries += 1
        self.hits += hit
        self.refs.setdefault(identifier, set()).add(request.request_id)
        self.idle.pop(identifier, None)

    def allocate(self, request: Request, identifier: str, num_tokens: int) -> None:
        """Room for an output the runner computes this step, evicting idle ones as needed."""
        while self.used + num_tokens > self.capacity and self.idle:
            old, _ = self.idle.popitem(last=False)
            self.used -= self.sizes.pop(old)
            self.refs.pop(old, None)
            self.freed.append(old)
        self.sizes[identifier] = num_tokens
        self.used += num_tokens
        self.reference(request, identifier, hit=False)

    def release(self, request: Request, identifier: str) -> None:
        """``request`` no longer needs ``identifier`` (its placeholders are computed)."""
        holders = self.refs.get(identifier)
        if holders is None or request.request_id not in holders:
            return
        holders.discard(request.request_id)
        if not holders and identifier in self.sizes:
            self.idle[identifier] = None

    def release_all(self, request: Request) -> None:
        """A request that ended or was preempted lets go of every image it held."""
        if request.mm_inputs is None:
            return
        for f in request.mm_inputs.features:
            self.release(request, f.identifier)

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
