"""The core's offload medium: blocks in CPU memory, copies on their own CUDA stream.

Each worker keeps its part of every offloaded block (its KV heads, every layer) in one CPU
tensor ``[num_blocks, num_layers, *block]``: pinned memory on CUDA, so that copies run
asynchronously. A job's copies are queued after everything the step's stream has queued so
far, stores (device to CPU) on one side stream and loads on another, so that both directions of
the bus work at once; stores gather the blocks of each layer into a staging tensor and copy
block by block, loads do the reverse. Loads wait for stores, and the step's stream for either,
only where the scheduler says they touch the same blocks (``stores_first``, ``wait_jobs``).
On a CPU the copies are plain and done at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pagoda.kv_offload.medium import OffloadMedium
from pagoda.kv_offload.transfers import KVTransfers

# Blocks (of every layer) staged on the device at once: bounds the staging memory.
_STAGING_BYTES = 64 << 20


def _runs(src: list[int], dst: list[int]) -> Iterator[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both id lists go up by one."""
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        yield src[i], dst[i], j - i
        i = j


class CPUMedium(OffloadMedium):
    def __init__(self, kv_caches: list[torch.Tensor], block_dim: int, num_blocks: int) -> None:
        super().__init__(kv_caches, block_dim, num_blocks)
        first = kv_caches[0]
        self.device = first.device
        self.cuda = self.device.type == "cuda"
        block_shape = tuple(self.layers[0].shape[1:])
        self.cpu = torch.empty(
            (num_blocks, len(kv_caches), *block_shape),
            dtype=first.dtype,
            pin_memory=self.cuda,
        )
        self.block_bytes = self.cpu[0].numel() * first.element_size()
        self.chunk = max(1, _STAGING_BYTES // self.block_bytes)
        if self.cuda:
            self.store_stream = torch.cuda.Stream(self.device)
            self.load_stream = torch.cuda.Stream(self.device)
        # job id -> the events that end its stores and its loads (none on a CPU: done)
        self._jobs: dict[int, list[torch.cuda.Event]] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._jobs)

    def submit(self, t: KVTransfers) -> None:
        """Queue a job's copies and the waits the step's forward owes (called before the
        step's forward is queued)."""
        if t.has_copies:
            if self.cuda:
                self._submit_cuda(t)
            else:
                self._store(t.store_gpu, t.store_cpu)
                self._load(t.load_cpu, t.load_gpu)
                self._jobs[t.job_id] = []
        if self.cuda:
            main = torch.cuda.current_stream(self.device)
            for job in t.wait_jobs:
                for ev in self._jobs.get(job, ()):
                    main.wait_event(ev)

    def poll(self, wait: bool = False) -> list[int]:
        """Jobs whose copies are done, each reported once; ``wait``: wait for all of them."""
        done = []
        for job, events in list(self._jobs.items()):
            if not all(ev.query() for ev in events):
                if not wait:
                    continue
                for ev in events:
                    ev.synchronize()
            done.append(job)
            del self._jobs[job]
        return done

    # ---- copies ----------------------------------------------------------------------------------

    def _submit_cuda(self, t: KVTransfers) -> None:
        main = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(main)  # the blocks hold what every step queued so far wrote
        events = []
        stored = None
        if t.store_gpu:
            with torch.cuda.stream(self.store_stream):
                self.store_stream.wait_event(ready)
                self._store(t.store_gpu, t.store_cpu)
                stored = torch.cuda.Event()
                stored.record(self.store_stream)
            events.append(stored)
            if t.stores_first:  # the step (and this job's loads) overwrite what they read
                main.wait_event(stored)
        if t.load_cpu:
            with torch.cuda.stream(self.load_stream):
                self.load_stream.wait_event(ready)
                if t.stores_first and stored is not None:
                    self.load_stream.wait_event(stored)
                for job in t.wait_jobs:  # older stores of the blocks these loads fill
                    for ev in self._jobs.get(job, ()):
                        self.load_stream.wait_event(ev)
                self._load(t.load_cpu, t.load_gpu)
                loaded = torch.cuda.Event()
                loaded.record(self.load_stream)
            events.append(loaded)
        self._jobs[t.job_id] = events

    def _index(self, ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids, dtype=torch.int64)
        return t.pin_memory().to(self.device, non_blocking=True) if self.cuda else t

    def _store(self, gpu: list[int], cpu: list[int]) -> None:
        for s in range(0, len(gpu), self.chunk):
            g, c = gpu[s : s + self.chunk], cpu[s : s + self.chunk]
            idx = self._index(g)
            if not self.cuda:
                for layer, kv in enumerate(self.layers):
                    self.cpu[torch.tensor(c), layer] = kv.index_select(0, idx)
                continue
            staging = torch.empty(
                (len(g), *self.cpu.shape[1:]), dtype=self.cpu.dtype, device=self.device
            )
            for layer, kv in enumerate(self.layers):
                staging[:, layer] = kv.index_select(0, idx)
            for i, dst, n in _runs(list(range(len(c))), c):
                self.cpu[dst : dst + n].copy_(staging[i : i + n], non_blocking=True)

    def _load(self, cpu: list[int], gpu: list[int]) -> None:
        for s in range(0, len(gpu), self.chunk):
            c, g = cpu[s : s + self.chunk], gpu[s : s + self.chunk]
            idx = self._index(g)
            if not self.cuda:
                src = self.cpu[torch.tensor(c)]
                for layer, kv in enumerate(self.layers):
                    kv.index_copy_(0, idx, src[:, layer])
                continue
            staging = torch.empty(
                (len(g), *self.cpu.shape[1:]), dtype=self.cpu.dtype, device=self.device
            )
            for src, i, n in _runs(c, list(range(len(c)))):
                staging[i : i + n].copy_(self.cpu[src : src + n], non_blocking=True)
            for layer, kv in enumerate(self.layers):
                kv.index_copy_(0, idx, staging[:, layer])
