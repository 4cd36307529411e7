"""The core's offload medium: blocks in CPU memory, copies on their own CUDA streams.

Each worker keeps its part of every offloaded block (its KV heads, every layer) in one CPU
tensor ``[num_blocks, num_layers, *block]``: pinned memory on CUDA, so that copies run
asynchronously and at the bus's speed (torch's pinned allocator rounds it up to a power of two
of bytes: a pool just under one wastes least). A job's copies are queued after everything the
step's stream has queued so far, stores (device to CPU) on one side stream and loads on another,
so that both directions of the bus work at once. A load moves each run of consecutive slots to a
device staging buffer with one host-to-device copy (up to ``_STAGING_BYTES`` at a time), then
scatters the staged blocks into the cache: with one kernel for every layer when the layers'
caches are slices of one tensor (the model runner allocates them so), one a layer otherwise. A
store gathers, then copies runs out the same way. Loads wait for stores, and the step's stream
for either, only where the scheduler says they touch the same blocks (``stores_first``,
``wait_jobs``). On a CPU the copies are plain and done at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from pagoda.kv_offload.medium import OffloadMedium
from pagoda.step import KVTransfers

# Bytes staged on the device at once, for each direction: the size of one bus copy at most.
_STAGING_BYTES = 64 << 20


def _runs(src: Sequence[int], dst: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both id lists go up by one."""
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        yield src[i], dst[i], j - i
        i = j


def stack_layers(layers: list[torch.Tensor]) -> torch.Tensor | None:
    """``layers`` (each ``[num_blocks, *block]``) as one view ``[num_blocks, num_layers,
    *block]`` when they are equally spaced, non-overlapping slices of one allocation; None
    otherwise (then each layer is copied on its own)."""
    first = layers[0]
    if len(layers) == 1:
        return first.unsqueeze(1)
    step = layers[1].storage_offset() - first.storage_offset()
    span = 1 + sum((n - 1) * s for n, s in zip(first.shape, first.stride()))
    if step < span:
        return None
    ptr = first.untyped_storage().data_ptr()
    for i, t in enumerate(layers):
        if (
            t.untyped_storage().data_ptr() != ptr
            or t.shape != first.shape
            or t.stride() != first.stride()
            or t.dtype != first.dtype
            or t.storage_offset() != first.storage_offset() + i * step
        ):
            return None
    size = (first.shape[0], len(layers), *first.shape[1:])
    stride = (first.stride(0), step, *first.stride()[1:])
    return first.as_strided(size, stride, first.storage_offset())


_BYTE_FLOATS = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class _Job:
    """A submitted job's events: those that end its copies, and (kind, blocks, start, end) of
    each direction, for the copy figures."""

    ends: list[torch.cuda.Event] = field(default_factory=list)
    timed: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)


class CPUMedium(OffloadMedium):
    def __init__(self, kv_caches: list[torch.Tensor], block_dim: int, num_blocks: int) -> None:
        # NOTE: an FP8 cache (cache.kv_cache_dtype) moves as its bytes: the gathers and
        # scatters below have no FP8 kernels on a CPU.
        if kv_caches and kv_caches[0].dtype in _BYTE_FLOATS:
            kv_caches = [kv.view(torch.uint8) for kv in kv_caches]
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
        # Every layer's cache as one view, blocks first (None: the layers are apart).
        self.stacked = stack_layers(self.layers)
        self.chunk = max(1, min(num_blocks, _STAGING_BYTES // self.block_bytes))
        # Blocks copied each way and the seconds the copies took on the device (CUDA), from
        # the first copy of a job's direction to its last: the bus's figures, as measured.
        self.copied = {"store_blocks": 0, "store_s": 0.0, "load_blocks": 0, "load_s": 0.0}
        if self.cuda:
            self.store_stream = torch.cuda.Stream(self.device)
            self.load_stream = torch.cuda.Stream(self.device)
        self._staging: dict[str, torch.Tensor] = {}  # per direction, used on its stream only
        self._jobs: dict[int, _Job] = {}  # submitted, not reported done

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
                if t.store_gpu:
                    self._store(t.store_gpu, t.store_cpu)
                if t.load_cpu:
                    self._load(t.load_cpu, t.load_gpu)
                self._jobs[t.job_id] = _Job()
        if self.cuda:
            main = torch.cuda.current_stream(self.device)
            for job in t.wait_jobs:
                for ev in self._ends(job):
                    main.wait_event(ev)

    def poll(self, wait: bool = False) -> list[int]:
        """Jobs whose copies are done, each reported once; ``wait``: wait for all of them."""
        done = []
        for job_id, job in list(self._jobs.items()):
            if not all(ev.query() for ev in job.ends):
                if not wait:
                    continue
                for ev in job.ends:
                    ev.synchronize()
            for kind, n, start, end in job.timed:
                self.copied[f"{kind}_blocks"] += n
                self.copied[f"{kind}_s"] += start.elapsed_time(end) / 1000
            done.append(job_id)
            del self._jobs[job_id]
        return done

    def _ends(self, job_id: int) -> list[torch.cuda.Event]:
        job = self._jobs.get(job_id)
        return job.ends if job is not None else []

    # ---- copies ----------------------------------------------------------------------------------

    def _submit_cuda(self, t: KVTransfers) -> None:
        main = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(main)  # the blocks hold what every step queued so far wrote
        job = _Job()
        stored = None
        if t.store_gpu:
            with torch.cuda.stream(self.store_stream):
                self.store_stream.wait_event(ready)
                stored = self._timed(job, "store", len(t.store_gpu), self.store_stream,
                                     lambda: self._store(t.store_gpu, t.store_cpu))  # fmt: skip
            if t.stores_first:  # the step (and this job's loads) overwrite what they read
                main.wait_event(stored)
        if t.load_cpu:
            with torch.cuda.stream(self.load_stream):
                self.load_stream.wait_event(ready)
                if t.stores_first and stored is not None:
                    self.load_stream.wait_event(stored)
                for job_id in t.wait_jobs:  # older stores of the blocks these loads fill
                    for ev in self._ends(job_id):
                        self.load_stream.wait_event(ev)
                self._timed(job, "load", len(t.load_cpu), self.load_stream,
                            lambda: self._load(t.load_cpu, t.load_gpu))  # fmt: skip
        self._jobs[t.job_id] = job

    @staticmethod
    def _timed(
        job: _Job, kind: str, n: int, stream: torch.cuda.Stream, copy: Callable[[], None]
    ) -> torch.cuda.Event:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        copy()
        end.record(stream)
        job.ends.append(end)
        job.timed.append((kind, n, start, end))
        return end

    def _index(self, ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids, dtype=torch.int64)
        return t.pin_memory().to(self.device, non_blocking=True) if self.cuda else t

    def _staging_buffer(self, kind: str) -> torch.Tensor:
        """The direction's staging blocks on the device, made on first use on its stream."""
        buf = self._staging.get(kind)
        if buf is None:
            shape = (self.chunk, *self.cpu.shape[1:])
            buf = torch.empty(shape, dtype=self.cpu.dtype, device=self.device)
            self._staging[kind] = buf
        return buf

    def _gather(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        """Device blocks ``idx``, every layer, into ``out`` (``[len(idx), layers, *block]``)."""
        if self.stacked is not None:
            torch.index_select(self.stacked, 0, idx, out=out)
            return
        for layer, kv in enumerate(self.layers):
            out[:, layer].copy_(kv.index_select(0, idx))

    def _scatter(self, idx: torch.Tensor, src: torch.Tensor) -> None:
        """``src`` (``[len(idx), layers, *block]``) into device blocks ``idx``, every layer."""
        if self.stacked is not None:
            self.stacked.index_copy_(0, idx, src)
            return
        for layer, kv in enumerate(self.layers):
            kv.index_copy_(0, idx, src[:, layer])

    def _store(self, gpu: list[int], cpu: list[int]) -> None:
        if not self.cuda:
            out = torch.empty((len(gpu), *self.cpu.shape[1:]), dtype=self.cpu.dtype)
            self._gather(torch.tensor(gpu, dtype=torch.int64), out)
            self.cpu[torch.tensor(cpu, dtype=torch.int64)] = out
            return
        idx = self._index(gpu)
        staging = self._staging_buffer("store")
        for s in range(0, len(gpu), self.chunk):
            c = cpu[s : s + self.chunk]
            self._gather(idx[s : s + len(c)], staging[: len(c)])
            for dst, i, n in _runs(c, range(len(c))):
                self.cpu[dst : dst + n].copy_(staging[i : i + n], non_blocking=True)

    def _load(self, cpu: list[int], gpu: list[int]) -> None:
        if not self.cuda:
            src = self.cpu[torch.tensor(cpu, dtype=torch.int64)]
            self._scatter(torch.tensor(gpu, dtype=torch.int64), src)
            return
        idx = self._index(gpu)
        staging = self._staging_buffer("load")
        for s in range(0, len(gpu), self.chunk):
            c = cpu[s : s + self.chunk]
            for src, i, n in _runs(c, range(len(c))):
                staging[i : i + n].copy_(self.cpu[src : src + n], non_blocking=True)
            self._scatter(idx[s : s + len(c)], staging[: len(c)])
