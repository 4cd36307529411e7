"""The model runner's side of structured output: one matcher per constrained request, and each
step one token bitmask for the rows that sample, applied to the logits before sampling.

A matcher follows its request's tokens in the runner's rows: before a step samples, it has
accepted every token the request has. The work is done off the host's critical path: once a
step that sampled constrained rows is launched, a background thread waits for its sampled ids,
advances those matchers over them and fills their rows of the next bitmask (the grammar
backend's calls release the GIL), while the host reads outputs, schedules and prepares the next
step. The next step takes the filled rows; a request the prefetch did not cover (new, resumed,
or after a step without it) is advanced and filled there and then.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagoda.config import EngineConfig
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import GrammarBackend, GrammarMatcher, bitmask_width
from pagoda.structured_output.manager import process_manager
from pagoda.structured_output.mask import GrammarMask
from pagoda.structured_output.remote import RemoteGrammarRows

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    matcher: GrammarMatcher
    backend: type[GrammarBackend]
    num_accepted: int = 0  # output tokens the matcher has accepted
    broken: bool = False  # a token was refused: the row is no longer constrained
    # The prefetch that filled this request's next row: (its generation, the row in its buffer).
    prefetched: tuple[int, int] | None = None

    @property
    def live(self) -> bool:
        return not self.broken and not self.matcher.is_terminated()


class GrammarRows:
    def __init__(self, config: EngineConfig, vocab_size: int, max_num_reqs: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.max_num_reqs = max_num_reqs
        self.entries: dict[str, _Entry] = {}
        self._buffers: list[torch.Tensor] = []  # made on first use (pinned on CUDA)
        self._next_buffer = 0
        self._pool: cf.ThreadPoolExecutor | None = None
        self._prefetch: cf.Future[None] | None = None
        self._generation = 0
        self._prefetch_order: list[str] = []  # the sampling rows' requests of the prefetch

    def add(self, req_id: str, params: StructuredOutputsParams | None) -> None:
        """A request the runner takes in (new, or resumed: its matcher starts over)."""
        self.entries.pop(req_id, None)
        if params is None:
            return
        compiled = process_manager(self.config).compiled(params)
        self.entries[req_id] = _Entry(compiled.new_matcher(), compiled.backend)

    def remove(self, req_id: str) -> None:
        self.entries.pop(req_id, None)

    def after_launch(self, out: Any, device: torch.device) -> None:
        """A step whose sampling is launched (``out``, a ``StepOutput``): prefetch the next
        bitmask rows of its constrained requests."""
        sampled_ids = [out.req_ids[i] for i in out.sample_idx]
        self.prefetch(sampled_ids, out.sampled, out.event, device)

    def after_sample(self, out: Any, sampled: torch.Tensor) -> None:
        """Nothing here: ``after_launch`` prefetches once the step's event is recorded."""

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    # ---- buffers -------------------------------------------------------------------------------

    def _buffer(self, device: torch.device) -> torch.Tensor:
        """The next of two host buffers. NOTE: a buffer is refilled two steps after it was
        copied to the device, by when that step (and its copy) has ended. The host writes them
        through numpy views: a torch op on a tensor this size runs on torch's OpenMP threads
        (a second team of them when called from the grammar thread), which spin after it on
        the cores the grammar backend's own threads fill the rows on."""
        if not self._buffers:
            shape = (self.max_num_reqs, bitmask_width(self.vocab_size))
            pin = device.type == "cuda"
            self._buffers = [
                torch.full(shape, -1, dtype=torch.int32, pin_memory=pin) for _ in range(2)
            ]
        buf = self._buffers[self._next_buffer]
        self._next_buffer ^= 1
        return buf

    # ---- the prefetch --------------------------------------------------------------------------

    def prefetch(
        self,
        req_ids: list[str],
        sampled: torch.Tensor,
        event: Any,
        device: torch.device,
    ) -> None:
        """After launching a step that sampled rows of requests ``req_ids``: in the background,
        wait for ``event`` (None: the ids are there), advance the constrained requests over
        their ids in ``sampled`` (host, one per row) and fill their next bitmask rows."""
        self._join()
        items = [(j, self.entries.get(r)) for j, r in enumerate(req_ids)]
        items = [(j, e) for j, e in items if e is not None and e.live]
        if not items:
            return
        for _, e in items:
            e.prefetched = None
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar-mask")
        self._generation += 1
        self._prefetch_order = list(req_ids)
        buf = self._buffer(device)
        self._prefetch = self._pool.submit(
            self._prefetch_rows, items, sampled, event, buf, self._generation, len(req_ids)
        )

    @torch.inference_mode()  # the buffers were made in the runner's inference mode
    def _prefetch_rows(
        self,
        items: list[tuple[int, _Entry]],
        sampled: torch.Tensor,
        event: Any,
        buf: torch.Tensor,
        generation: int,
        n: int,
    ) -> None:
        if event is not None:
            event.synchronize()
        tokens = sampled.numpy()
        entries = [e for _, e in items]
        got = [int(tokens[j]) for j, _ in items]
        backend = entries[0].backend
        ok = backend.accept_batch([e.matcher for e in entries], got)
        for e, accepted, t in zip(entries, ok, got):
            self._accepted(e, 1, accepted, [t])
        live = [(j, e) for j, e in items if e.live]
        buf.numpy()[:n] = -1  # NOTE: numpy, not torch: see _buffer
        if live:
            backend.fill_bitmasks([e.matcher for _, e in live], buf, [j for j, _ in live])
        for j, e in live:
            e.prefetched = (generation, j)

    def _join(self) -> None:
        if self._prefetch is not None:
            future, self._prefetch = self._prefetch, None
            future.result()  # an error in the thread surfaces here

    # ---- one step's mask -----------------------------------------------------------------------

    def mask(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        token_ids: np.ndarray,
        num_tokens: np.ndarray,
        num_prompt: np.ndarray,
        wait_for_sampled: Callable[[], None],
        device: torch.device,
    ) -> GrammarMask | None:
        """The bitmask of the sampling rows ``rows`` (of requests ``req_ids``), or None when
        none is constrained. ``token_ids``/``num_tokens``/``num_prompt``: the runner's rows; a
        token still on the device reads -1, and ``wait_for_sampled()`` brings it to the host."""
        self._join()
        idx = [i for i, r in enumerate(req_ids) if r in self.entries]
        if not idx:
            return None
        entries = [self.entries[req_ids[i]] for i in idx]
        sel = rows[idx]
        starts = num_prompt[sel] + np.fromiter((e.num_accepted for e in entries), np.int64)
        ends = num_tokens[sel]
        if (ends > starts).any():  # tokens the prefetch did not cover
            # NOTE: only a row's last token can be still on the device (the last step's sample).
            if ((ends > starts) & (token_ids[sel, np.maximum(ends - 1, 0)] < 0)).any():
                wait_for_sampled()
            self._advance(entries, sel, starts, ends, token_ids)
        live = [j for j, e in enumerate(entries) if e.live]
        if not live:
            return None
        backend = entries[live[0]].backend
        constrained = [idx[j] for j in live]
        gen = self._generation
        ready = [entries[j].prefetched for j in live]
        if req_ids == self._prefetch_order and all(
            p is not None and p[0] == gen and p[1] == i for p, i in zip(ready, constrained)
        ):
            bitmask = self._buffers[self._next_buffer ^ 1][: len(req_ids)]  # the prefetch's
        else:
            bitmask = self._gather(entries, live, constrained, len(req_ids), device)
        for j in live:
            entries[j].prefetched = None
        return GrammarMask(backend, bitmask.to(device, non_blocking=True), constrained)

    def _gather(
        self,
        entries: list[_Entry],
        live: list[int],
        constrained: list[int],
        n: int,
        device: torch.device,
    ) -> torch.Tensor:
        """A step's bitmask from the prefetched rows still valid, and fresh fills for others."""
        gen = self._generation
        source = self._buffers[self._next_buffer ^ 1] if self._buffers else None
        out = self._buffer(device)
        if source is not None:  # NOTE: rows are copied out before anything overwrites source
            saved = source.numpy()[: len(self._prefetch_order)].copy()
        out.numpy()[:n] = -1
        todo = []
        for j, i in zip(live, constrained):
            p = entries[j].prefetched
            if p is not None and p[0] == gen and source is not None:
                out.numpy()[i] = saved[p[1]]
            else:
                todo.append((j, i))
        if todo:
            backend = entries[todo[0][0]].backend
            backend.fill_bitmasks([entries[j].matcher for j, _ in todo], out, [i for _, i in todo])
        return out[:n]

    def _advance(
        self,
        entries: list[_Entry],
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        token_ids: np.ndarray,
    ) -> None:
        """Feed each matcher the tokens its request gained; one batched call for the common
        case of one token each."""
        one = [j for j, e in enumerate(entries) if ends[j] - starts[j] == 1 and not e.broken]
        if one:
            backend = entries[one[0]].backend
            tokens = token_ids[rows[one], starts[one]].tolist()
            ok = backend.accept_batch([entries[j].matcher for j in one], tokens)
            for j, accepted in zip(one, ok):
                self._accepted(entries[j], 1, accepted, tokens)
        for j, e in enumerate(entries):
            n = int(ends[j] - starts[j])
            if n > 1 and not e.broken:
                tokens = token_ids[rows[j], starts[j] : ends[j]].tolist()
                self._accepted(e, n, e.matcher.accept_tokens(tokens), tokens)
            if n > 0:
                e.prefetched = None  # the matcher moved on: a prefetched row is stale

    @staticmethod
    def _accepted(entry: _Entry, n: int, ok: bool, tokens: list[int]) -> None:
        entry.num_accepted += n
        if not ok and not entry.matcher.is_terminated():
            # NOTE: only a token sampled against the mask gets here (all its logits were -inf,
            # say, min_tokens banning the end the grammar requires). The row goes free rather
            # than stall; its output is what it is.
            entry.broken = True
            logger.warning("a constrained request's token was refused by its grammar: %s", tokens)


def grammar_rows(
    config: EngineConfig, vocab_size: int, max_num_reqs: int, device: torch.device | None = None
) -> GrammarRows | RemoteGrammarRows:
    """The runner's matchers: in a process of their own (``structured_output.matcher_process``)
    or in a thread of this one."""
    remote = config.structured_output.matcher_process
    if remote == "auto":  # a GPU engine's step is short enough for the loop to feel the matchers
        remote = device is not None and device.type == "cuda"
    if remote:  # started with the engine, in the background (see RemoteGrammarRows)
        return RemoteGrammarRows(config, vocab_size, max_num_reqs)
    return GrammarRows(config, vocab_size, max_num_reqs)
