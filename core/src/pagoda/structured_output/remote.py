"""Grammar matchers in a process of their own (``structured_output.matcher_process``).

Advancing a batch's matchers and filling their bitmask rows is about a millisecond of work at
batch 64, much of it inside the grammar backend with Python's GIL held. In the engine's process
that work competes with the engine loop itself, which on a GPU is what bounds a small model's
step. Here a child process owns the matchers. Behind each constrained step's sampling the
device copies the sampled ids, then the step's number, into shared pinned memory; the child,
told which request each row is, watches the number, advances the matchers as soon as the ids
land and fills the next step's rows into a shared buffer, where the runner's next sampling
finds them (``RemoteGrammarRows``, the same interface as ``GrammarRows``). Once a step's rows
are filled the child writes the step's number into a second pinned flag; on a GPU the runner does
not wait for the child's answer before it launches the sampling that applies them: it enqueues a
wait for that number on the device ahead of the mask's copy (``pagoda.structured_output.
host_flag``) and takes the answers (which requests broke or ended) as they come.

Messages, in order on one pipe: ``("add", req_id, params)``, ``("remove", req_id)``,
``("step_ids", seq, rows, fill, buffer, n)`` (advance ``rows``' requests by the ids of step
``seq``; ``rows`` and ``fill`` None: the same as the last such message), ``("step", seq,
advance, fill, buffer, n)`` (advance by the tokens given) and ``("stop",)``. ``rows``:
``[(req_id, row of the ids)]``; ``advance``: ``[(req_id, tokens)]``; ``fill``: ``[(req_id,
row)]`` to fill in ``buffer`` (rows up to ``n`` not filled are all ones). Steps are numbered
in order and the child takes them in that order.

The usual step sends nothing: when a step's rows are the last ``step_ids``' rows, the runner
writes ``(seq, buffer, n)`` into a shared ring (``seq`` last) before it enqueues the ids' copy,
and the child, finding step ``seq`` there, takes it as that message with ``rows`` None. A
``step`` is answered with ``(seq, status)``; a ``step_ids`` only when a status changed, and
before the child writes ``filled``; ``status``: ``{req_id: (broken, terminated)}`` for every
request named whose status changed since the child last answered for it (a new matcher is
neither). The child counts its answers in shared memory, so the runner looks for them without
a system call.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as tmp

from pagoda.model_info import ModelInfo
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import GrammarBackend, bitmask_width
from pagoda.structured_output.manager import StructuredOutputManager, select_grammar_backend
from pagoda.structured_output.mask import GrammarMask

logger = logging.getLogger(__name__)

_PREFETCH_BUFFERS = 2  # alternate between steps; one more for fills on the runner's path
_IDS_TIMEOUT_S = 600.0  # a step's ids not copied by then: the engine is gone
_SPIN_S = 0.005  # the child spins this long for a step's ids before it sleeps between looks
_DEVICE_WAIT_S = 30.0  # a fill the device waited for this long: the child is lost
_RING = 16  # steps announced through shared memory (the runner is never this far ahead)


class MatcherProcessError(RuntimeError):
    """The grammar matcher process failed or ended."""


@dataclass
class _Entry:
    sent: int = 0  # output tokens sent to the child
    broken: bool = False  # a token was refused: the row is no longer constrained
    terminated: bool = False

    @property
    def live(self) -> bool:
        return not self.broken and not self.terminated


class RemoteGrammarRows:
    """``GrammarRows``, with the matchers in a child process (see the module's note)."""

    def __init__(self, config: Any, vocab_size: int, max_num_reqs: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.max_num_reqs = max_num_reqs
        self.entries: dict[str, _Entry] = {}
        self._backend: type[GrammarBackend] | None = None
        self._conn: Any = None
        self._proc: Any = None
        self._buffers: list[torch.Tensor] = []
        self._registered: list[torch.Tensor] = []
        self._next = 0
        self._seq = 0
        self._outstanding: list[int] = []  # "step" messages not answered yet
        self._received = 0  # answers taken (the child counts those it sent)
        self.num_announced = 0  # steps sent through the ring, without a message
        # (seq, order, buffer, fill): the child's fill of the next step's rows, under way
        self._prefetch: tuple[int, list[str], int, list] | None = None
        self._last_rows: tuple[list, list] | None = None  # the child keeps them too
        self._device_wait = False  # the device waits for the child's fill (see host_flag)
        self._seq_device: torch.Tensor | None = None
        # (seq, order, buffer, entries, rows): the last fill, when its every row was a live
        # constrained request's (see ``after_sample``)
        self._steady: tuple | None = None
        # Started with the engine, in the background, so that the first constrained request does
        # not wait for the child's start (an interpreter, torch, the backend's vocabulary
        # tables: seconds); if that fails here, the first constrained request starts it again
        # and reports why.
        try:
            self._start()
        except Exception as e:  # noqa: BLE001
            # NOTE: info, not a warning: a GPU engine with no grammar backend installed gets here
            logger.info("structured output: the matcher process did not start: %s", e)
            self._proc = None

    # ---- the child -----------------------------------------------------------------------------

    def _start(self) -> None:
        self._backend = select_grammar_backend(self.config.structured_output.backend)
        shape = (self.max_num_reqs, bitmask_width(self.vocab_size))
        self._buffers = [
            torch.full(shape, -1, dtype=torch.int32).share_memory_()
            for _ in range(_PREFETCH_BUFFERS + 1)
        ]
        # A step's sampled ids, then its message's number, copied here behind its sampling:
        # the child watches the number and reads the ids as soon as the device has them.
        self._ids = torch.zeros(self.max_num_reqs, dtype=torch.int64).share_memory_()
        self._flag = torch.zeros(1, dtype=torch.int64).share_memory_()
        # The number of the last step whose rows the child has filled (it writes it after the
        # rows), and the word the device's wait for it writes when it gives up.
        self._filled = torch.zeros(1, dtype=torch.int64).share_memory_()
        # The child's own account of the steps fed by the device: how many, the seconds from
        # their ids landing to their rows filled (sum, max), and the seconds it waited for ids.
        self.child_stats = torch.zeros(4, dtype=torch.float64).share_memory_()
        self._wait_error = torch.zeros(1, dtype=torch.int64).share_memory_()
        # Steps sent without a message (see the module's note), and the child's answers sent.
        self._ring = torch.zeros((_RING, 3), dtype=torch.int64).share_memory_()
        self._ring_np = self._ring.numpy()
        self._replies = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._replies_np = self._replies.numpy()
        self._filled_np = self._filled.numpy()
        if torch.cuda.is_available():  # pinned, so copies do not wait for the host
            cudart = torch.cuda.cudart()
            shared = [*self._buffers, self._ids, self._flag, self._filled, self._wait_error]
            for b in shared:
                if cudart.cudaHostRegister(b.data_ptr(), b.numel() * b.element_size(), 0) == 0:
                    self._registered.append(b)
                else:  # copies from it wait for the host; the device wait is off (below)
                    _clear_cuda_error()
            # NOTE: host_flag imports Triton: only where a CUDA device may wait.
            from pagoda.structured_output.host_flag import device_wait_available

            self._device_wait = len(self._registered) == len(shared) and device_wait_available(
                torch.device("cuda")
            )
        ctx = tmp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve,
            args=(
                child,
                self.config,
                self._buffers,
                self._ids,
                self._flag,
                self._filled,
                self.child_stats,
                self._ring,
                self._replies,
            ),
            name="pagoda-grammar-matchers",
            daemon=True,
        )
        with _main_not_imported():
            self._proc.start()
        child.close()
        # One stop, whichever comes first: close() or the collector (a second cudaHostUnregister
        # of the same buffers fails, and its error would surface at the next CUDA call).
        self._finalizer = weakref.finalize(self, _stop, self._conn, self._proc, self._registered)

    def _send(self, msg: tuple) -> None:
        if self._proc is None:
            self._start()
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError) as e:
            raise MatcherProcessError(f"the grammar matcher process ended: {e}") from None

    def _step(self, advance: list, fill: list, buffer: int, n: int) -> int:
        self._seq += 1
        self._send(("step", self._seq, advance, fill, buffer, n))
        self._outstanding.append(self._seq)
        return self._seq

    def _drain(self, wait: bool = True) -> None:
        """Take the answers that have come (``wait``: and those of every ``step`` sent)."""
        while (wait and self._outstanding) or self._replies_np[0] > self._received:
            try:
                reply = self._conn.recv()
            except (EOFError, OSError) as e:
                raise MatcherProcessError(f"the grammar matcher process ended: {e!r}") from None
            self._received += 1
            if reply[0] == "error":
                raise MatcherProcessError(f"the grammar matcher process failed: {reply[1]}")
            seq, status = reply
            if seq in self._outstanding:
                self._outstanding.remove(seq)
            for req_id, (broken, terminated) in status.items():
                e = self.entries.get(req_id)
                if e is not None:
                    e.broken, e.terminated = broken, terminated

    def _wait_filled(self, seq: int) -> None:
        """The host waits until the child has filled step ``seq``'s rows, then takes the
        answers (the child sends a step's answer before it writes ``filled``)."""
        start = time.monotonic()
        while self._filled_np[0] < seq:
            if self._replies_np[0] > self._received:
                self._drain(wait=False)  # an error, say
                continue
            if time.monotonic() - start > _DEVICE_WAIT_S:
                alive = self._proc is not None and self._proc.is_alive()
                raise MatcherProcessError(
                    f"the grammar matcher process did not fill step {seq}'s bitmask within "
                    f"{_DEVICE_WAIT_S:.0f} s "
                    + ("(it is still running)" if alive else "(it has ended)")
                )
            time.sleep(2e-5)
        self._drain(wait=False)

    def close(self) -> None:
        if self._proc is not None:
            self._finalizer()
            self._proc = None

    # ---- GrammarRows' interface ----------------------------------------------------------------

    def add(self, req_id: str, params: StructuredOutputsParams | None) -> None:
        if req_id in self.entries:
            self.remove(req_id)
        if params is None:
            return
        self.entries[req_id] = _Entry()
        self._steady = None
        self._send(("add", req_id, params))

    def remove(self, req_id: str) -> None:
        if self.entries.pop(req_id, None) is not None:
            self._steady = None
            self._send(("remove", req_id))

    def after_launch(self, out: Any, device: torch.device) -> None:
        """Nothing: ``after_sample`` sent the step's ids on their way."""

    def after_sample(self, out: Any, sampled: torch.Tensor) -> None:
        """``out``'s sampling is launched and ``sampled`` holds its ids (on the device): copy
        them, then this message's number, to the shared buffers behind it, and tell the child
        which request each row is; it advances the matchers as soon as the ids land and fills
        the next step's rows in the same order."""
        order = [out.req_ids[i] for i in out.sample_idx]
        steady = self._steady
        if steady is not None and order == steady[1]:
            # The last step's requests, in its order, all constrained: nothing to work out.
            entries = steady[3]
            for e in entries:
                e.sent += 1
            advance = fill = self._last_rows[0] if self._last_rows else []
        else:
            if not any(r in self.entries for r in order):
                return
            advance, fill, entries = [], [], []
            for j, req_id in enumerate(order):
                e = self.entries.get(req_id)
                if e is None:
                    continue
                entries.append(e)
                e.sent += 1
                if e.live:
                    advance.append((req_id, j))
                    fill.append((req_id, j))
            if not advance:
                self._steady = None
                return
        if self._proc is None:
            self._start()
        if self._device_wait:  # the step's output is not handed on if its mask's wait failed
            prev = out.on_output

            def checked(step: Any, output: Any) -> None:
                self._check_device_wait()
                if prev is not None:
                    prev(step, output)

            out.on_output = checked
        n = len(order)
        seq = self._seq + 1
        buffer = self._next
        self._next = (self._next + 1) % _PREFETCH_BUFFERS
        self._seq = seq
        if (advance, fill) == self._last_rows:
            # The usual step: the batch did not change. No message: the ring announces it,
            # its number written last, before the ids' copy is enqueued (see the module's note).
            slot = self._ring_np[seq % _RING]
            slot[1], slot[2] = buffer, n
            slot[0] = seq
            self.num_announced += 1
        else:
            self._send(("step_ids", seq, advance, fill, buffer, n))
            self._last_rows = (advance, fill)
        if sampled.device.type == "cuda":
            self._ids[:n].copy_(sampled, non_blocking=True)
            if self._seq_device is None:
                self._seq_device = torch.zeros(1, dtype=torch.int64, device=sampled.device)
            self._seq_device.fill_(seq)  # NOTE: stream-ordered after the last step's copy of it
            self._flag.copy_(self._seq_device, non_blocking=True)
        else:
            self._ids[:n].copy_(sampled)
            self._flag[0] = seq
        self._prefetch = (seq, order, buffer, fill)
        # Every row a live constrained request's: the next mask of these requests, in this
        # order, is this fill as it is (``mask``'s first case), until a request comes or goes.
        if len(fill) == n:
            self._steady = (seq, order, buffer, entries, list(range(n)))
        else:
            self._steady = None

    def mask(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        token_ids: np.ndarray,
        num_tokens: np.ndarray,
        num_prompt: np.ndarray,
        wait_for_sampled: Any,
        device: torch.device,
    ) -> Any:
        """As ``GrammarRows.mask``."""
        steady = self._steady
        prefetch = self._prefetch
        if (
            steady is not None
            and prefetch is not None
            and prefetch[0] == steady[0]
            and req_ids == steady[1]
        ):
            # The usual step: the requests of the last sampling, in its order, each advanced by
            # exactly its last token (constrained requests get no drafts; one that is preempted
            # or ends is removed), every row constrained and filled by the child.
            self._prefetch = None
            bitmask = self._buffers[steady[2]][: len(req_ids)]
            if self._device_wait:
                self._check_device_wait()
                self._drain(wait=False)
                return _FillAwaited(self._backend, bitmask, steady[4], self, steady[0])
            self._wait_filled(steady[0])
            if not any(e.live for e in steady[3]):
                return None
            return GrammarMask(self._backend, bitmask.to(device, non_blocking=True), steady[4])
        idx = [i for i, r in enumerate(req_ids) if r in self.entries]
        if not idx:
            return None
        entries = [self.entries[req_ids[i]] for i in idx]
        sel = rows[idx]
        ends = num_tokens[sel]

        def starts() -> np.ndarray:
            return num_prompt[sel] + np.fromiter((e.sent for e in entries), np.int64, len(idx))

        live = np.fromiter((e.live for e in entries), bool, len(idx))
        behind = (ends > starts()) & live
        if behind.any() and (token_ids[sel, np.maximum(ends - 1, 0)][behind] < 0).any():
            wait_for_sampled()  # brings them to the host rows
        s = starts()
        advance = []
        for j in np.flatnonzero(ends > s).tolist():
            e = entries[j]
            if e.live:
                tokens = token_ids[sel[j], s[j] : ends[j]].tolist()
                advance.append((req_ids[idx[j]], tokens))
            e.sent += int(ends[j] - s[j])
        seq = self._prefetch[0] if self._prefetch is not None else None
        order = self._prefetch[1] if self._prefetch is not None else None
        usable = not advance and order == req_ids
        if usable:  # every live constrained row was filled by the child, at its place here
            filled_rows = dict(self._prefetch[3])
            usable = all(filled_rows.get(req_ids[i]) == i for e, i in zip(entries, idx) if e.live)
        if usable and self._device_wait:
            # The device, not the host, waits for the child's fill (see host_flag); answers
            # are taken as they come (a row that ended meanwhile is all ones: no constraint).
            self._check_device_wait()
            self._drain(wait=False)
            buffer = self._prefetch[2]
        elif usable:
            self._wait_filled(seq)
            buffer = self._prefetch[2]
        else:
            fill = [(req_ids[i], i) for e, i in zip(entries, idx) if not e.broken]
            buffer = _PREFETCH_BUFFERS
            self._step(advance, fill, buffer, len(req_ids))
            self._drain()
        self._prefetch = None
        constrained = [i for e, i in zip(entries, idx) if e.live]
        if not constrained:
            return None
        bitmask = self._buffers[buffer][: len(req_ids)]
        if usable and self._device_wait:
            return _FillAwaited(self._backend, bitmask, constrained, self, seq)
        return GrammarMask(self._backend, bitmask.to(device, non_blocking=True), constrained)

    def _apply_once_filled(self, logits: torch.Tensor, mask: _FillAwaited) -> torch.Tensor:
        """The device waits for the child's fill of step ``mask.seq`` (see host_flag), then
        copies the rows in and applies them."""
        if self._device_wait:
            # NOTE: host_flag imports Triton: only where a CUDA device waits.
            from pagoda.structured_output.host_flag import wait_for

            try:
                wait_for(self._filled, self._wait_error, mask.seq, _DEVICE_WAIT_S)
            except Exception as e:  # noqa: BLE001 - no device wait here: the host waits instead
                logger.warning(
                    "structured output: the device cannot wait for the matcher process (%s); "
                    "the host waits for it",
                    e,
                )
                self._device_wait = False
                self._wait_filled(mask.seq)
        else:
            self._wait_filled(mask.seq)
        bitmask = mask.bitmask.to(logits.device, non_blocking=True)
        self._backend.apply_bitmask(logits, bitmask, mask.rows)
        return logits

    def _check_device_wait(self) -> None:
        """Fail, rather than sample with stale rows, once a device wait gave up on the child."""
        if self._wait_error.numpy()[0] != 0:
            alive = self._proc is not None and self._proc.is_alive()
            raise MatcherProcessError(
                f"the grammar matcher process did not fill step {int(self._wait_error[0])}'s "
                f"bitmask within {_DEVICE_WAIT_S:.0f} s "
                + ("(it is still running)" if alive else "(it has ended)")
            )


class _FillAwaited:
    """A step's mask whose rows the child may still be filling: applying it enqueues the
    device's wait for them (``RemoteGrammarRows._apply_once_filled``)."""

    def __init__(
        self,
        backend: Any,
        bitmask: torch.Tensor,
        rows: list[int],
        owner: RemoteGrammarRows,
        seq: int,
    ) -> None:
        self.backend, self.bitmask, self.rows = backend, bitmask, rows  # bitmask: on the host
        self.owner, self.seq = owner, seq

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self.owner._apply_once_filled(logits, self)


@contextlib.contextmanager
def _main_not_imported() -> Iterator[None]:
    """Start a spawned child without running the user's main script in it.

    A spawned child imports the parent's ``__main__`` (by its file or module name) before it
    runs its target, and that runs whatever the script does outside an ``if __name__ ==
    "__main__":`` guard: a script that builds an ``LLM`` and generates at top level ran twice,
    the second time inside the matcher process, which never got to serve. The child needs
    nothing from ``__main__`` (its target and arguments live in pagoda), so the parent's
    ``__main__`` shows neither while the child starts.
    """
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if hasattr(main, k)}
    try:
        for k in saved:
            if k == "__spec__":
                main.__spec__ = None
            else:
                delattr(main, k)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def _clear_cuda_error() -> None:
    """Take the error a failed CUDA runtime call left behind: the runtime keeps it for the next
    call that checks, and torch would raise it from an unrelated allocation or launch."""
    cudart = torch.cuda.cudart()
    if hasattr(cudart, "cudaGetLastError"):
        cudart.cudaGetLastError()
        return
    try:  # NOTE: torch's launch check reads (and so clears) the pending error
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


def _stop(conn: Any, proc: Any, registered: list[torch.Tensor]) -> None:
    try:
        conn.send(("stop",))
    except (BrokenPipeError, OSError):
        pass
    proc.join(timeout=1)  # NOTE: a child still starting (an engine that never used it) is killed
    if proc.is_alive():
        proc.kill()
    cudart = torch.cuda.cudart() if registered else None
    for b in registered:
        if int(cudart.cudaHostUnregister(b.data_ptr())) != 0:
            _clear_cuda_error()
            logger.warning("structured output: a matcher buffer was not registered at stop")
    registered.clear()


def _serve(
    conn: Any,
    config: Any,
    buffers: list[torch.Tensor],
    ids: torch.Tensor,
    flag: torch.Tensor,
    filled: torch.Tensor,
    stats: torch.Tensor,
    ring: torch.Tensor,
    replies: torch.Tensor,
) -> None:
    """The child: matchers by request, advanced and filled as the messages (and the ring) say."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops us
    torch.set_num_threads(1)
    # This process does nothing but advance and fill, and a late fill stalls the device: the
    # backend's fill runs on every CPU but two, which are left to the engine loop (its step is
    # host-bound on a small model, and a fill thread beside it on its CPU slows every step),
    # with about half as many threads as it has CPUs (see _fill_threads).
    _leave_cpus_to_the_engine()
    manager = StructuredOutputManager(config, ModelInfo.from_config(config))
    try:  # the vocabulary's tables now, while the engine starts, not on the first request
        manager.backend  # noqa: B018
    except Exception:  # noqa: BLE001 - the first request that needs it reports why
        logger.exception("grammar matcher process: the grammar backend did not build")
    matchers: dict[str, list] = {}  # req_id -> [matcher, backend, broken]
    filled_np = filled.numpy()
    stats_np = stats.numpy()
    ring_np = ring.numpy()
    replies_np = replies.numpy()
    last_rows: tuple[list, list] = ([], [])
    inbox: collections.deque = collections.deque()
    last_seq = 0  # steps come in order: by message or through the ring
    idle_since = time.monotonic()

    def answer(msg: tuple) -> None:
        conn.send(msg)
        replies_np[0] += 1  # NOTE: after the send: the runner's recv then finds it

    def take(op: str, msg: tuple) -> None:
        nonlocal last_rows, last_seq
        if op == "add":
            compiled = manager.compiled(msg[2])
            matchers[msg[1]] = [compiled.new_matcher(), compiled.backend, False]
        elif op == "remove":
            matchers.pop(msg[1], None)
        elif op == "step":
            _, seq, advance, fill, buffer, n = msg
            last_seq = seq
            status = _advance_and_fill(matchers, advance, fill, buffers[buffer], n)
            answer((seq, status))
            filled_np[0] = seq  # NOTE: after the rows: a device waiting for it reads them next
        elif op == "step_ids":  # advance by the ids the device copies to ``ids``
            _, seq, rows, fill, buffer, n = msg
            last_seq = seq
            if rows is None:  # the same rows as the last such step
                rows, fill = last_rows
            last_rows = (rows, fill)
            t0 = time.perf_counter()
            tokens = _wait_for_ids(flag, ids, seq, n)
            t1 = time.perf_counter()
            advance = [(r, [int(tokens[j])]) for r, j in rows]
            status = _advance_and_fill(matchers, advance, fill, buffers[buffer], n)
            if status:
                answer((seq, status))
            filled_np[0] = seq
            work = time.perf_counter() - t1
            stats_np[0] += 1
            stats_np[1] += work
            stats_np[2] = max(stats_np[2], work)
            stats_np[3] += t1 - t0

    def read_pipe() -> bool:
        """Every message the pipe holds into ``inbox``; False once the engine is gone."""
        try:
            while conn.poll():
                inbox.append(conn.recv())
        except (EOFError, OSError):
            return False
        return True

    while True:
        if not read_pipe():
            return
        msg = None
        if inbox and (inbox[0][0] in ("add", "remove", "stop") or inbox[0][1] == last_seq + 1):
            msg = inbox.popleft()
        else:
            slot = ring_np[(last_seq + 1) % _RING]
            if slot[0] == last_seq + 1:
                # A step announced without a message: what the runner sent before it (added
                # or removed requests) is in the pipe by now, and goes first.
                buffer, n = int(slot[1]), int(slot[2])
                if not read_pipe():
                    return
                if inbox and inbox[0][0] in ("add", "remove", "stop"):
                    continue
                msg = ("step_ids", last_seq + 1, None, None, buffer, n)
        if msg is None:
            idle = time.monotonic() - idle_since
            # NOTE: spin for the length of a small model's step (the child has CPUs of its
            # own: a sleep's wake-up would delay every fill), then look less often.
            if idle > 1.0:
                conn.poll(0.01)
            elif idle > _SPIN_S:
                conn.poll(1e-4)
            continue
        op = msg[0]
        if op == "stop":
            return
        try:
            take(op, msg)
        except Exception as e:  # noqa: BLE001 - the runner raises it
            logger.exception("grammar matcher process: %s failed", op)
            if op in ("step", "step_ids"):
                answer(("error", f"{type(e).__name__}: {e}"))
        idle_since = time.monotonic()


def _leave_cpus_to_the_engine() -> None:
    """In the child: run on all the engine's CPUs but the first two, and fill with about half as
    many threads (``PAGODA_XGRAMMAR_MASK_THREADS`` set by the user is kept)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = list(range(os.cpu_count() or 1))
    if len(cpus) >= 6:
        cpus = cpus[2:]
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass
    if "PAGODA_XGRAMMAR_MASK_THREADS" not in os.environ:
        os.environ["PAGODA_XGRAMMAR_MASK_THREADS"] = str(_fill_threads(len(cpus)))


def _fill_threads(num_cpus: int) -> int:
    """Half the child's CPUs, less one, at most 8. A batch's fill is split evenly between the
    threads, so it ends with the last of them: with a thread on nearly every CPU, any other
    thread that lands on one (the engine's, the system's) holds the whole fill back. On a
    16-CPU H200 host (14 CPUs for the child) a batch of 64 took 1.36 ms a step with 6 threads
    and 4.2 ms with 13, in one session (2.65 ms with 1)."""
    return max(1, min(8, num_cpus // 2 - 1))


def _wait_for_ids(flag: torch.Tensor, ids: torch.Tensor, seq: int, n: int) -> np.ndarray:
    """The ids of message ``seq``, once the device's copy of them has landed (it writes the
    number after the ids)."""
    f = flag.numpy()
    start = time.monotonic()
    while f[0] < seq:
        # NOTE: spin for the length of a small model's step (the child has CPUs of its own: a
        # sleep's wake-up would delay every fill), then wait without a busy core.
        if time.monotonic() - start > _SPIN_S:
            time.sleep(5e-5)
            if time.monotonic() - start > _IDS_TIMEOUT_S:
                raise TimeoutError(f"step {seq}'s sampled ids did not arrive")
    return ids.numpy()[:n].copy()


def _advance_and_fill(
    matchers: dict[str, list], advance: list, fill: list, buffer: torch.Tensor, n: int
) -> dict[str, tuple[bool, bool]]:
    status: dict[str, tuple[bool, bool]] = {}  # only what changed (see the module's note)
    one = [(r, t[0]) for r, t in advance if len(t) == 1 and r in matchers and not matchers[r][2]]
    if one:
        backend = matchers[one[0][0]][1]
        ok = backend.accept_batch([matchers[r][0] for r, _ in one], [t for _, t in one])
        for (r, _), accepted in zip(one, ok):
            if not accepted and not matchers[r][0].is_terminated():
                matchers[r][2] = True
    for r, tokens in advance:
        if len(tokens) > 1 and r in matchers and not matchers[r][2]:
            m = matchers[r][0]
            if not m.accept_tokens(tokens) and not m.is_terminated():
                matchers[r][2] = True
    live = []
    for r, row in fill:
        entry = matchers.get(r)
        if entry is not None and not entry[2] and not entry[0].is_terminated():
            live.append((entry, row))
    rest = np.ones(n, dtype=bool)  # rows not filled allow everything
    rest[[row for _, row in live]] = False
    buffer.numpy()[:n][rest] = -1
    if live:
        backend = live[0][0][1]
        backend.fill_bitmasks([e[0] for e, _ in live], buffer, [row for _, row in live])
    for r, _ in list(advance) + list(fill):
        entry = matchers.get(r)
        if entry is not None:
            now = (entry[2], entry[0].is_terminated())
            if now != (False, False) and (len(entry) < 4 or entry[3] != now):
                entry[3:] = [now]
                status[r] = now
    return status
