"""The runner's side of pooling requests (vLLM's ``PoolingRunner``): the hidden states of their
prompt chunks, kept across steps where the pooler reads every token (``PoolingStates``), and
their pooled outputs once a prompt is done.

A step's pooling requests are pooled together: the last (or first) token of every request whose
prompt ends in the step is one gather; mean and per-token pooling work per request. The outputs
of a step travel to the host in one copy, behind the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.pooling.config import PoolerConfig
from pagoda.pooling.ops import classifier_activation, finish_embedding
from pagoda.pooling_params import PoolingParams


@dataclass
class _State:
    """A pooling request's prompt so far: the hidden states its pooler still needs."""

    params: PoolingParams
    chunks: list[torch.Tensor] = field(default_factory=list)  # ALL: every chunk; CLS: the first
    total: torch.Tensor | None = None  # MEAN: the float32 sum of the chunks' rows


@dataclass
class PooledStep:
    """One step's pooled outputs, flat on the host (in flight until the step's event)."""

    req_ids: list[str]
    shapes: list[tuple[int, ...]]
    flat: torch.Tensor

    def split(self) -> dict[str, np.ndarray]:
        """Each request's output: views of the step's outputs, copied once out of a page-locked
        buffer (which then goes back to the allocator for the next step's copy, not held as
        long as a caller keeps an output)."""
        data = self.flat.numpy()
        if self.flat.is_pinned():
            data = data.copy()
        out, start = {}, 0
        for rid, shape in zip(self.req_ids, self.shapes):
            n = int(np.prod(shape))
            out[rid] = data[start : start + n].reshape(shape)
            start += n
        return out


class PoolingRunner:
    def __init__(
        self, model: torch.nn.Module, config: PoolerConfig, bidirectional: bool = False
    ) -> None:
        """``bidirectional``: every attention layer of the model sees the whole prompt (an
        encoder), so any one row a request may attend alone in its last layer."""
        self.model = model
        self.config = config
        self.bidirectional = bidirectional
        self.states: dict[str, _State] = {}
        self.dtype = next(model.parameters()).dtype

    def add(self, req_id: str, params: PoolingParams) -> None:
        self.states[req_id] = _State(params)

    def forget(self, req_ids: set[str] | list[str]) -> None:
        for rid in req_ids:
            self.states.pop(rid, None)

    def kept_rows(
        self, req_ids: list[str], qsl: np.ndarray, done: np.ndarray, starts: np.ndarray
    ) -> np.ndarray | None:
        """The one row a request the step reads, when that is all it reads: every request of
        the step (``req_ids``, their rows ``qsl``) ends its prompt here and pools its last
        token, or (a bidirectional model, the prompt whole in this step: ``starts`` 0) its
        first. None otherwise."""
        if not done.all():
            return None
        states = self.states
        rows = qsl[1:] - 1
        for i, rid in enumerate(req_ids):
            st = states.get(rid)
            kind = None if st is None else st.params.pooling_type
            if kind == "LAST":
                continue
            if kind != "CLS" or not self.bidirectional or starts[i] != 0:
                return None
            rows[i] = qsl[i]
        return rows

    def pool(
        self,
        hidden: torch.Tensor,
        req_ids: list[str],
        idx: np.ndarray,
        qsl: np.ndarray,
        done: np.ndarray,
        num_prompt: np.ndarray,
        as_device: object,
    ) -> PooledStep | None:
        """Pool the step's pooling requests ``idx`` (indices into the step's requests, whose
        tokens are ``hidden[qsl[i]:qsl[i + 1]]``); ``done[i]``: its prompt ends in this step;
        ``num_prompt[i]``: its prompt's length. Returns the outputs of those done."""
        finished: list[tuple[str, PoolingParams, torch.Tensor | None]] = []
        gather_rows: list[int] = []  # one row each for LAST, and CLS/MEAN met whole in one step
        for i in idx.tolist():
            rid = req_ids[i]
            st = self.states[rid]
            kind = st.params.pooling_type
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            if not done[i]:
                if kind == "ALL" or (kind == "CLS" and not st.chunks):
                    keep = hidden[lo:hi] if kind == "ALL" else hidden[lo : lo + 1]
                    st.chunks.append(keep.clone())
                elif kind == "MEAN":
                    part = hidden[lo:hi].float().sum(0)
                    st.total = part if st.total is None else st.total + part
                continue
            if kind == "LAST":
                gather_rows.append(hi - 1)
                finished.append((rid, st.params, None))
            elif kind == "CLS":
                finished.append((rid, st.params, st.chunks[0][0] if st.chunks else hidden[lo]))
            elif kind == "MEAN":
                total = hidden[lo:hi].float().sum(0)
                if st.total is not None:
                    total = total + st.total
                finished.append((rid, st.params, total / float(num_prompt[i])))
            else:
                finished.append((rid, st.params, torch.cat([*st.chunks, hidden[lo:hi]])))
            del self.states[rid]
        if not finished:
            return None
        rows: list[torch.Tensor] = []  # one [hidden] row per request that pools to one vector
        if gather_rows:
            gathered = hidden[as_device(np.asarray(gather_rows, dtype=np.int64))]
        g = 0
        for _, params, pooled in finished:
            if pooled is None:
                rows.append(gathered[g])
                g += 1
            elif params.pooling_type != "ALL":
                rows.append(pooled)
        outs: dict[str, torch.Tensor] = {}
        vectors = [(rid, p) for rid, p, pooled in finished if p.pooling_type != "ALL"]
        if vectors:
            stacked = gathered if len(rows) == len(gather_rows) else torch.stack(rows)
            groups: dict[tuple, list[int]] = {}
            for j, (_, p) in enumerate(vectors):
                key = (p.task in ("classify", "score"), p.dimensions, p.normalize, p.activation)
                groups.setdefault(key, []).append(j)
            if len(groups) == 1 and len(vectors) == len(finished):
                # Every request of the step pooled alike (an embedding batch): one finish, and
                # the flat output is its rows, in order.
                part = self._finish(vectors[0][1], stacked)
                return self._to_host([rid for rid, _ in vectors], part)
            for members in groups.values():
                # NOTE: the rows picked by a device index: indexing by a host list copies it
                # to the device in a copy that waits for the step (the host would then prepare
                # the next step with the device idle).
                picked = stacked[as_device(np.asarray(members, dtype=np.int64))]
                part = self._finish(vectors[members[0]][1], picked)
                for j, row in zip(members, part):
                    outs[vectors[j][0]] = row
        for rid, params, pooled in finished:
            if params.pooling_type == "ALL":
                outs[rid] = self._finish(params, pooled)
        ids = [f[0] for f in finished]
        shapes = [tuple(outs[r].shape) for r in ids]
        flat = torch.cat([outs[r].reshape(-1) for r in ids])
        return PooledStep(ids, shapes, self._copy_to_host(flat))

    def _to_host(self, ids: list[str], part: torch.Tensor) -> PooledStep:
        """The step's outputs when they are the rows of ``part`` ([len(ids), d]), in order."""
        shape = tuple(part.shape[1:])
        return PooledStep(ids, [shape] * len(ids), self._copy_to_host(part.reshape(-1)))

    @staticmethod
    def _copy_to_host(flat: torch.Tensor) -> torch.Tensor:
        if flat.is_cuda:
            # NOTE: into page-locked memory, or the copy is not asynchronous: ``to("cpu",
            # non_blocking=True)`` into pageable memory waits for the step, and the host then
            # prepares the next step while the device idles (5 ms a step of 16,384 tokens).
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            return host.copy_(flat, non_blocking=True)
        return flat

    def _finish(self, params: PoolingParams, pooled: torch.Tensor) -> torch.Tensor:
        """Rows pooled alike (``[n, hidden]``): through the classifier head, or truncated and
        normalised as embeddings."""
        if params.task in ("classify", "score"):
            logits = self.model.classify(pooled.to(self.dtype))
            return classifier_activation(logits) if params.activation else logits.float()
        return finish_embedding(pooled, params.dimensions, bool(params.normalize))
