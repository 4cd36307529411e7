"""The target's hidden states for a proposer that asks for them (``needs_hidden_states``).

The runner computes them anyway: the final hidden state is the forward's output, and the
residual stream entering a layer is copied, inside the same forward (CUDA graphs included),
into one persistent buffer by a pre-hook on that layer. After each forward the rows of the step
are gathered into a fresh tensor (the next step overwrites the buffer); a request still
prefilling keeps its chunks here until the step where it samples, when the proposer gets all of
them (``ProposalBatch.new_hidden_states``).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from pagoda.spec_decode.proposer import SpeculativeProposer
from pagoda.worker.step_buffers import StepBuffers
from pagoda.worker.step_output import StepOutput


def _decoder_layers(model: torch.nn.Module) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    norm = getattr(inner, "norm", None)
    if layers is None or norm is None:
        raise ValueError(
            f"the proposer asks for hidden states of target layers, but {type(model).__name__} "
            "has no model.layers and model.norm to read them from"
        )
    return list(layers), norm


class HiddenFeed:
    #: Positions a request keeps while drafting is off (``hold(bounded=True)``): older ones
    #: are dropped, and the proposer's next catch-up starts after them (a draft head then
    #: attends to what its cache held there). A bound on the memory a long stretch of plain
    #: steps would otherwise hold (each kept row also keeps its step's rows alive).
    max_hold = 64

    def __init__(
        self,
        proposer: SpeculativeProposer,
        model: torch.nn.Module,
        buffers: StepBuffers,
        row_of: dict[str, int],
        max_model_len: int,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> None:
        """``row_of``: the runner's rows by request id (``InputBatch.row_of``), read as they
        change."""
        self.layers = tuple(proposer.hidden_state_layers)
        self.device = buffers.device
        self._as_device = buffers.as_device
        self._row_of = row_of
        self._max_model_len = max_model_len
        h = hidden_size
        self.buf: torch.Tensor | None = None
        # req_id -> (first position, row blocks, their row count): joined when taken
        self._pending: dict[str, tuple[int, list[torch.Tensor], int]] = {}
        # Steps read while drafting was off, oldest first (``defer``): held when next needed.
        self._deferred: deque[StepOutput] = deque(maxlen=self.max_hold)
        if not self.layers:
            return
        decoder, norm = _decoder_layers(model)
        n_layers = len(decoder)
        bad = [i for i in self.layers if not 0 <= i <= n_layers]
        if bad:
            raise ValueError(
                f"the proposer asks for the hidden states entering layers {list(self.layers)}; "
                f"the target has {n_layers} layers (valid: 0..{n_layers}), not {bad}"
            )
        rows = max(buffers.max_num_tokens, buffers.max_num_reqs)
        self.buf = torch.empty(rows, h * len(self.layers), dtype=dtype, device=self.device)
        for j, i in enumerate(self.layers):
            module = decoder[i] if i < n_layers else norm
            # Layers take (positions, x, residual); the final norm takes (x, residual).
            arg = 1 if i < n_layers else 0
            module.register_forward_pre_hook(self._copier(j * h, (j + 1) * h, arg))

    def _copier(self, lo: int, hi: int, arg: int):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x, residual = args[arg], args[arg + 1] if len(args) > arg + 1 else None
            # (a layer's x is None where the last one added it into the residual already)
            stream = x if residual is None else residual if x is None else x + residual
            self.buf[: stream.shape[0], lo:hi].copy_(stream)

        return hook

    def record(
        self,
        out: StepOutput,
        hidden: torch.Tensor,
        req_ids: list[str],
        starts: np.ndarray,
        qsl: np.ndarray,
        sample_idx: np.ndarray,
        padded_q: int | None,
    ) -> None:
        """After a step's forward: keep its rows (``padded_q``: the step ran as a verification
        graph, whose buffer holds request i's tokens from row ``i * padded_q``)."""
        total = int(qsl[-1])
        if self.buf is None:
            rows = hidden[:total].clone()
        elif padded_q is None or total == (len(qsl) - 1) * padded_q:  # no padding in the buffer
            rows = self.buf[:total].clone()
        else:
            counts = np.diff(qsl)
            tok_req = np.repeat(np.arange(len(counts)), counts)
            index = tok_req * padded_q + (np.arange(total) - qsl[tok_req])
            rows = self.buf[self._as_device(index)]
        out.hidden_feed = (rows, qsl.copy(), starts.copy())
        if len(sample_idx) == len(req_ids):  # every request sampled (decoding)
            return
        self._flush()
        sampled = np.zeros(len(req_ids), dtype=bool)
        sampled[sample_idx] = True
        for i in np.flatnonzero(~sampled).tolist():  # chunks of prompts still prefilling
            chunk = rows[qsl[i] : qsl[i + 1]]
            self._keep(req_ids[i], int(starts[i]), chunk)

    def _keep(self, req_id: str, start: int, chunk: torch.Tensor) -> None:
        """Keep ``chunk`` (from position ``start``) after the request's pending rows, or
        instead of them when they do not meet."""
        first, kept, n = self._pending.get(req_id, (start, [], 0))
        if first + n != start:
            first, kept, n = start, [], 0
        self._pending[req_id] = (first, [*kept, chunk], n + len(chunk))

    def _join(self, req_id: str, start: int, chunk: torch.Tensor) -> torch.Tensor:
        """The request's pending rows followed by ``chunk`` (from position ``start``), or
        ``chunk`` alone when they do not meet; none pend after."""
        self._keep(req_id, start, chunk)
        _, kept, _ = self._pending.pop(req_id)
        return kept[0] if len(kept) == 1 else torch.cat(kept)

    def take(
        self, step: StepOutput, keep: np.ndarray, num_tokens: np.ndarray
    ) -> tuple[torch.Tensor, np.ndarray]:
        """The rows of the sampling requests ``step.sample_idx[keep]``, which now know
        ``num_tokens`` tokens: ``(new_hidden_states, hidden_loc)`` of ``ProposalBatch``."""
        self._flush()
        rows, qsl, starts = step.hidden_feed
        idx = step.sample_idx[keep]
        idx_l = idx.tolist()
        ids = [step.req_ids[i] for i in idx_l]
        if not any(r in self._pending for r in ids):
            # NOTE: plain Python: this runs every step that drafts, mostly for a few requests.
            # Positions first .. num_tokens - 2 of the step are known to be followed by a token.
            qsl_l, starts_l = qsl.tolist(), starts.tolist()
            loc_l, lo, end, run = [0], 0, -1, True  # run: the rows are one slice (decoding)
            for i, n in zip(idx_l, num_tokens.tolist()):
                q0 = qsl_l[i]
                m = min(max(n - 1 - starts_l[i], 0), qsl_l[i + 1] - q0)
                if m:
                    if end < 0:
                        lo = q0
                    elif q0 != end:
                        run = False
                    end = q0 + m
                loc_l.append(loc_l[-1] + m)
            loc = np.asarray(loc_l, dtype=np.int64)
            if run:
                return rows[lo : lo + loc_l[-1]], loc
            m = np.diff(loc)
            flat = np.repeat(qsl[idx] - loc[:-1], m) + np.arange(loc_l[-1])
            # NOTE: pinned and non-blocking: a blocking copy would wait for the step launched
            # since (the host would lose its lead over the device every step).
            return rows[self._as_device(flat)], loc
        first = starts[idx]
        m = np.clip(num_tokens - 1 - first, 0, np.diff(qsl)[idx])
        loc = np.zeros(len(idx) + 1, dtype=np.int64)
        parts = []
        for j, req_id in enumerate(ids):
            own = rows[qsl[idx[j]] : qsl[idx[j]] + m[j]]
            joined = self._join(req_id, int(first[j]), own)
            parts.append(joined)
            loc[j + 1] = loc[j] + len(joined)
        return torch.cat(parts), loc

    def hold(
        self, step: StepOutput, keep: np.ndarray, num_tokens: np.ndarray, bounded: bool = False
    ) -> None:
        """Keep the rows of the sampling requests ``step.sample_idx[keep]`` (which now know
        ``num_tokens`` tokens) for a later ``take``: their proposer was not asked this step.
        ``bounded``: at most the last ``max_hold`` positions of each request stay."""
        self._flush()
        self._hold(step, keep, num_tokens, bounded)

    def _hold(
        self, step: StepOutput, keep: np.ndarray, num_tokens: np.ndarray, bounded: bool
    ) -> None:
        rows, qsl, starts = step.hidden_feed
        for i, n in zip(step.sample_idx[keep].tolist(), num_tokens.tolist()):
            lo, first = int(qsl[i]), int(starts[i])
            m = min(max(n - 1 - first, 0), int(qsl[i + 1]) - lo)
            req_id = step.req_ids[i]
            self._keep(req_id, first, rows[lo : lo + m])
            if bounded:
                self._trim(req_id)

    def _trim(self, req_id: str) -> None:
        """Drop a request's oldest pending rows beyond ``max_hold``."""
        first, kept, n = self._pending[req_id]
        excess = n - self.max_hold
        if excess <= 0:
            return
        while excess >= len(kept[0]):
            excess -= len(kept[0])
            first, n = first + len(kept[0]), n - len(kept[0])
            kept = kept[1:]
        if excess:
            kept = [kept[0][excess:], *kept[1:]]
            first, n = first + excess, n - excess
        self._pending[req_id] = (first, kept, n)

    def defer(self, step: StepOutput) -> None:
        """A step read while drafting is off: its sampling requests' rows are held as
        ``hold(bounded=True)`` would, when the feed is next used (a catch-up, a prompt chunk, a
        look at ``pending``). One append a step instead of a request's bookkeeping each: a long
        stretch of plain steps costs the host nothing per request, and at most the last
        ``max_hold`` steps are kept."""
        self._deferred.append(step)

    def _flush(self) -> None:
        """Hold the deferred steps' rows, oldest first, for the requests that still own the
        row they sampled in (and can still draft: fewer tokens than the model's length)."""
        row_of, room = self._row_of, self._max_model_len
        while self._deferred:
            step = self._deferred.popleft()
            n_tok = step.sample_pos + step.num_emitted
            ids = [step.req_ids[i] for i in step.sample_idx.tolist()]
            ok = [
                n < room and row_of.get(r, -1) == row
                for r, row, n in zip(ids, step.sample_rows.tolist(), n_tok.tolist())
            ]
            if any(ok):
                keep = np.flatnonzero(ok)
                self._hold(step, keep, n_tok[keep], bounded=True)

    @property
    def pending(self) -> dict[str, tuple[int, list[torch.Tensor], int]]:
        """Request id -> (first position, row blocks, their row count) of the rows waiting for
        the proposer's next call."""
        self._flush()
        return self._pending

    def remove(self, req_ids) -> None:
        # NOTE: deferred steps are held first: a preempted request comes back under its id.
        self._flush()
        for req_id in req_ids:
            self._pending.pop(req_id, None)
