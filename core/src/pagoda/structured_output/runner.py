"""The model runner's side of structured output: one matcher per constrained request, and each
step one token bitmask for the rows that sample, applied to the logits before sampling.

A matcher follows its request's tokens in the runner's rows: before a step samples, it accepts
the tokens the request gained since (the last step's sampled one, or a resumed request's whole
output). With async scheduling the last step's token may still be on the device; the runner
then reads that step first, while this step's forward pass runs on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.config import EngineConfig
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import GrammarBackend, GrammarMatcher, bitmask_width

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    matcher: GrammarMatcher
    backend: type[GrammarBackend]
    num_accepted: int = 0  # output tokens the matcher has accepted
    broken: bool = False  # a token was refused: the row is no longer constrained


@dataclass
class GrammarMask:
    """One step's bitmask for the sampling rows that are constrained, on the logits' device;
    the sampler applies it to the processed logits (``Sampler.process_logits``)."""

    backend: type[GrammarBackend]
    bitmask: torch.Tensor  # [num sampling rows, words] int32; all ones where unconstrained
    rows: list[int]  # the constrained rows: indices into the step's sampling rows

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.backend.apply_bitmask(logits, self.bitmask, self.rows)
        return logits


class GrammarRows:
    def __init__(self, config: EngineConfig, vocab_size: int, max_num_reqs: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.entries: dict[str, _Entry] = {}
        self._bitmask = torch.full((max_num_reqs, bitmask_width(vocab_size)), -1, dtype=torch.int32)

    def add(self, req_id: str, params: StructuredOutputsParams | None) -> None:
        """A request the runner takes in (new, or resumed: its matcher starts over)."""
        self.entries.pop(req_id, None)
        if params is None:
            return
        from pagoda.structured_output.manager import process_manager

        compiled = process_manager(self.config).compiled(params)
        self.entries[req_id] = _Entry(compiled.new_matcher(), compiled.backend)

    def remove(self, req_id: str) -> None:
        self.entries.pop(req_id, None)

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
        idx = [i for i, r in enumerate(req_ids) if r in self.entries]
        if not idx:
            return None
        entries = [self.entries[req_ids[i]] for i in idx]
        sel = rows[idx]
        starts = num_prompt[sel] + np.fromiter((e.num_accepted for e in entries), np.int64)
        ends = num_tokens[sel]
        # NOTE: only a row's last token can be still on the device (the last step's sample).
        if ((ends > starts) & (token_ids[sel, np.maximum(ends - 1, 0)] < 0)).any():
            wait_for_sampled()
        self._advance(entries, sel, starts, ends, token_ids)
        live = [j for j, e in enumerate(entries) if not e.broken and not e.matcher.is_terminated()]
        if not live:
            return None
        backend = entries[live[0]].backend
        constrained = [idx[j] for j in live]
        bitmask = self._bitmask[: len(req_ids)]
        if len(constrained) < len(req_ids):
            bitmask.fill_(-1)
        backend.fill_bitmasks([entries[j].matcher for j in live], bitmask, constrained)
        if device.type == "cuda":  # NOTE: a pinned copy: the buffer is refilled next step
            on_device = bitmask.pin_memory().to(device, non_blocking=True)
        else:
            on_device = bitmask.clone()
        return GrammarMask(backend, on_device, constrained)

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

    @staticmethod
    def _accepted(entry: _Entry, n: int, ok: bool, tokens: list[int]) -> None:
        entry.num_accepted += n
        if not ok and not entry.matcher.is_terminated():
            # NOTE: only a token sampled against the mask gets here (all its logits were -inf,
            # say, min_tokens banning the end the grammar requires). The row goes free rather
            # than stall; its output is what it is.
            entry.broken = True
            logger.warning("a constrained request's token was refused by its grammar: %s", tokens)
