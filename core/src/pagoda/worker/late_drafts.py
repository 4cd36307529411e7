"""Drafts the host writes after the verification that takes them has been launched.

A proposer that reads only token history on the host (n-gram, suffix: those that set
``SpeculativeProposer.proposes_on_host``, :meth:`LateDrafts.fits`) drafts step N + 1 once step
N's tokens are on the host. With draft slots (``pagoda.worker.draft_slots``) the runner therefore
read N, proposed, built N + 1's inputs and replayed its graph, the device idle from N's end to
that replay. Where N verified drafts, N + 1's inputs other than its drafts follow from N's
outcome on the device (``pagoda.worker.drafts_ahead``). So the runner enqueues, behind N and
before reading it: a wait for a number the host writes (``pagoda.structured_output.host_flag``),
a program that reads the drafts from page-locked host memory, the inputs' build and the
verification graph's replay. It then reads N, proposes, writes the drafts and the number
(:meth:`LateDrafts.release`), and the device, which was waiting, goes on: it waits for the
proposal only, not for the host's input building and graph launch.

Each request gets a row of ``k`` drafts: its own, then filler. The verification scores every
row the graph holds, but only each request's own drafts are compared (its draft count, as for a
padded verification), so filler is never accepted and output is what the ordinary path gives. A
request the proposer gives nothing verifies no draft (one token, as a decode step).

Between the enqueue and :meth:`release` the host must not wait for the device's stream (that
wait would be for the flag it has yet to write): the runner only reads the step in flight
there, whose event was recorded before the wait, and asks the proposer, which reads history on
the host. :meth:`release` runs in a ``finally``; a flag that never comes lets the device go on
after ``timeout_s`` (with the last drafts written: the verification stays lossless, the step
is slow), and :meth:`check` reports it.

NOTE: a launch this process has not made before (a kernel whose module the driver loads at its
first launch, a Triton kernel's first compile) waits on the host until the device is idle;
behind a wait for a number only this host writes, it waits the whole bound out, and the copy
then reads drafts not yet written. The first verification of ``n`` requests is therefore
launched with its drafts written before the wait (filler: each request verifies ``k`` drafts
it will not accept, still lossless), and :meth:`enqueue` returns them so that the host verifies
what the device does.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pagoda.ops.launch import CachedLaunch
from pagoda.structured_output.host_flag import device_wait_available, wait_for

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

logger = logging.getLogger(__name__)

#: How long the device waits for the host's drafts before it goes on without them.
_TIMEOUT_S = 30.0
_BLOCK = 64

if triton is not None:

    @triton.jit(do_not_specialize=["count"])
    def _copy_from_host(src_ptr, dst_ptr, count, BLOCK: tl.constexpr):
        # Rows read from host memory by this program, when it runs: a copy engine's copy of a
        # few bytes is taken from host memory when it is enqueued (the driver puts small copies
        # in its command stream), before the host has written them.
        offs = tl.arange(0, BLOCK)
        for start in range(0, count, BLOCK):
            mask = start + offs < count
            rows = tl.load(src_ptr + start + offs, mask=mask, volatile=True)
            tl.store(dst_ptr + start + offs, rows, mask=mask)


_copy = CachedLaunch(_copy_from_host) if triton is not None else None


class LateDrafts:
    """Page-locked rows of up to ``max_reqs`` requests' ``k`` drafts, the number the device waits
    for, and the drafts' device copy a verification launched ahead reads."""

    def __init__(self, max_reqs: int, k: int, device: torch.device) -> None:
        self.k = k
        # NOTE: two host regions, used in turn: a step's copy reads its region only after its
        # flag, and the host writes a region again two steps later, once that step was read.
        self._host = [torch.zeros(max_reqs, k, dtype=torch.int64, pin_memory=True) for _ in "ab"]
        self._host_np = [h.numpy() for h in self._host]
        self.device_drafts = torch.zeros(max_reqs, k, dtype=torch.int64, device=device)
        self._flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._error = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        # (their host views, made once: ``check`` runs every step, and a view costs microseconds)
        self._flag_np, self._error_np = self._flag.numpy(), self._error.numpy()
        self._seq = 0
        self._open: tuple[int, int] | None = None  # (seq, requests) enqueued, not released
        self._launched: set[int] = set()  # request counts launched once (the module's note)
        self.launches = 0  # verifications launched behind a wait (``enqueue``)
        self.timeouts = 0  # waits that gave up (``check``)
        # NOTE: both kernels compiled and bound now: a first launch's compile between the wait
        # and the copy ran the wait past its bound (its polls take less than their nominal
        # microsecond), and the copy read drafts not yet written.
        wait_for(self._flag, self._error, 0, _TIMEOUT_S)
        dst = self.device_drafts
        for region in self._host:
            args = (region, dst, 0, _BLOCK)
            _copy((region.data_ptr(), dst.data_ptr()), (1,), args, num_warps=1)
        torch.cuda.synchronize(device)

    @staticmethod
    def available(device: torch.device) -> bool:
        return device_wait_available(device)

    @classmethod
    def fits(
        cls,
        proposer: Any,
        device: torch.device,
        *,
        asked_in_launch: bool,
        drafts_after_verify: bool,
        replans: bool,
    ) -> bool:
        """Whether a speculation's verifications may take their drafts late: its ``proposer``
        says it proposes on the host alone (``SpeculativeProposer.proposes_on_host``: one that
        waited on the device would wait for this wait), is asked in the launch, drafts nothing
        on the device after a verification, its verification graphs need no re-planning
        (``replans``), and ``device`` can wait."""
        return (
            bool(getattr(proposer, "proposes_on_host", False))
            and asked_in_launch
            and not drafts_after_verify
            and not replans
            and cls.available(device)
        )

    def enqueue(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On the current stream: wait for the host's drafts of ``n`` requests, then copy them
        to the device. Returns their device rows ([n, k]), which hold them once the stream gets
        past the wait, and None; or, the first time for ``n`` (see the module's note), those
        rows and the drafts they get, written already (filler, [n, k] on the host): nothing is
        then left to :meth:`release`."""
        if self._open is not None:
            raise RuntimeError("late drafts: the last enqueue was not released")
        self._seq += 1
        seq, src, dst = self._seq, self._host[self._seq % 2], self.device_drafts
        written = None
        if n not in self._launched:
            self._launched.add(n)
            src[:n] = 0
            written = src[:n].clone()
            self._flag_np[0] = seq
        else:
            self._open = (seq, n)
        wait_for(self._flag, self._error, seq, _TIMEOUT_S)
        _copy((src.data_ptr(), dst.data_ptr()), (1,), (src, dst, n * self.k, _BLOCK), num_warps=1)
        self.launches += 1
        return self.device_drafts[:n], written

    @property
    def open(self) -> bool:
        return self._open is not None

    def release(self, req_ids: list[str], proposals: dict[str, list[int]]) -> None:
        """Write each request's drafts (``proposals``, in ``req_ids``' order; missing: none)
        into the region the device copies from, then the number it waits for."""
        if self._open is None:
            return
        seq, n = self._open
        self._open = None
        rows = self._host_np[seq % 2]
        k = self.k
        for i, req_id in enumerate(req_ids[:n]):
            got = proposals.get(req_id)
            m = 0 if got is None else min(len(got), k)
            if m:
                rows[i, :m] = got[:m]
            if m < k:  # filler, never compared (see the module's note)
                rows[i, m:] = rows[i, m - 1] if m else 0
        self._flag_np[0] = seq  # NOTE: after the rows (stores reach the bus in order)

    def check(self) -> bool:
        """Whether a wait gave up since the last check (the host wrote its drafts too late: the
        verification went on with the region's old drafts, still lossless); logged, counted in
        ``timeouts``."""
        error = self._error_np
        if not error[0]:
            return False
        logger.error(
            "a verification's wait for its drafts (step %d) gave up; it went on without them",
            int(error[0]),
        )
        error[0] = 0
        self.timeouts += 1
        return True
