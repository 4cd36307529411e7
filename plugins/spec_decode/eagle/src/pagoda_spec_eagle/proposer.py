"""EAGLE and EAGLE-3 proposers: a draft head drafts k tokens a request as a chain.

Each call first catches the head up on every position the target computed since the request
last sampled (``ProposalBatch.new_hidden_states``; a prompt the first time, then the last
known token and the accepted drafts): one forward over all of them writes the head's keys and
values and its last row gives the first draft. Then k - 1 one-token steps, each feeding the
head's own output back as the hidden state, give the rest. Drafts are greedy (the head's
argmax), so they carry no ``probs``.

The head's KV cache is one layer parallel to the target's: position p of a request lives in the
same block and slot as in the target's cache (so prefix-cached blocks carry the head's keys
too). Chain positions past the request's blocks go to a few scratch blocks per row, after the
target's. Rejected chain positions are overwritten by the next catch-up.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagoda.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagoda.attention.layer import set_forward_context
from pagoda.spec_decode import (
    Drafts,
    ProposalBatch,
    ProposerContext,
    SpeculativeProposer,
    VerifiedBatch,
)
from pagoda.spec_decode.proposer import TargetModel
from pagoda.worker.host_memory import lazily_zeroed
from pagoda_spec_eagle.chain import DenseChain, table_width
from pagoda_spec_eagle.checkpoint import check_fits, read_head
from pagoda_spec_eagle.draft import EagleHead

logger = logging.getLogger(__name__)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers (the inputs of these layers), as vLLM and
    SpecForge pick them (clamped to ``0..num_layers`` for toy models)."""
    picks = (2, num_layers // 2, num_layers - 3)
    return tuple(min(max(i, 0), num_layers) for i in picks)  # type: ignore[return-value]


class EagleProposer(SpeculativeProposer):
    """``speculative: {method: eagle, model: HEAD_DIR, num_speculative_tokens: k}``."""

    kind = "eagle"
    needs_hidden_states = True
    draft_behind = True  # draft right after each verification, on the device (tests turn it off)

    def __init__(self, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        if not ctx.config.model:
            raise ValueError(
                f"speculative.method {self.kind!r} needs speculative.model: the folder of the "
                "draft head's checkpoint"
            )
        self.ckpt = read_head(ctx.config.model, self.kind)
        check_fits(self.ckpt, ctx.hidden_size, ctx.vocab_size)
        self.k = ctx.num_speculative_tokens
        self.head: EagleHead | None = None
        self._state: dict[str, _Backoff] = {}
        # The pause a new request starts from: that of the last request that drafted (1 if its
        # drafts were landing). A head that misses on every text then pays a draft every
        # ``_MAX_PAUSE`` steps from a request's start, not the ramp 1, 2, 4 .. on each request.
        self.start_pause = 1
        # req_id -> (drafts [n, k] copied to the host behind a step, row, first position):
        # drafted on the device right after that step's verification (draft_after_verify)
        self._ahead: dict[str, tuple[torch.Tensor, int, int]] = {}
        # The last draft_after_verify's drafts: (on the device, the host copy, request order).
        self._behind: tuple[torch.Tensor, torch.Tensor, list[str]] | None = None
        self.num_drafted_behind = 0  # requests' drafts that came from draft_after_verify

    def kv_cache_block_bytes(self, block_size: int) -> int:
        ck = self.ckpt
        return 2 * block_size * ck.num_kv_heads * ck.head_dim * self.ctx.dtype.itemsize

    def bind_target(self, target: TargetModel) -> None:
        ck, ctx = self.ckpt, self.ctx
        if ck.kind == "eagle3":
            layers = ck.aux_layers or default_aux_layers(target.num_hidden_layers)
            if len(layers) * ck.hidden_size != ck.weights["fc.weight"].shape[1]:
                raise ValueError(
                    f"{ck.label}: fc.weight takes {ck.weights['fc.weight'].shape[1]} features, "
                    f"not {len(layers)} layers of {ck.hidden_size}"
                )
            self.hidden_state_layers = tuple(layers)
        self.target = target
        head = EagleHead(ck, target.attn_backend, ctx.max_model_len + 2 * self.k + 2)
        head = head.to(device=ctx.device, dtype=ctx.dtype)
        head.rotary_emb.to(ctx.device)  # its tables stay float32
        head.load(ck)
        self.head = head.eval()
        ck.weights.clear()  # the head holds them now
        inner = target.model.model
        self.embed = head.embed_tokens if head.embed_tokens is not None else inner.embed_tokens
        self.block_size = bs = target.block_size
        # Scratch blocks for chain positions past a request's blocks: enough for k + 1 tokens;
        # then one block for pad rows to write to.
        self.scratch = (self.k + 1) // bs + 2
        self.first_scratch = target.num_blocks
        num_blocks = target.num_blocks + ctx.max_num_reqs * self.scratch + 1
        shape = target.attn_backend.get_kv_cache_shape(num_blocks, bs, ck.num_kv_heads, ck.head_dim)
        if ctx.device.type == "cpu":
            head.attn.kv_cache = lazily_zeroed(shape, ctx.dtype)
        else:
            head.attn.kv_cache = torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
        self.chain: DenseChain | None = None
        if shape == AttentionBackend.get_kv_cache_shape.__func__(
            AttentionBackend, num_blocks, bs, ck.num_kv_heads, ck.head_dim
        ):  # the default layout, which the fixed-shape draft reads
            width = table_width(ctx.max_model_len, self.k, bs, self.scratch)
            hidden_in = head.fc.in_features if head.eagle3 else ck.hidden_size
            self.chain = DenseChain(
                head, self._logits_to_ids, self.embed, self.k, width, bs, num_blocks - 1,
                hidden_in, ctx.device, ctx.dtype,
            )  # fmt: skip
            if ctx.device.type == "cuda":
                try:
                    self.chain.capture()
                except Exception:  # noqa: BLE001 (drafting goes on without the graphs)
                    logger.warning("EAGLE: drafts run eagerly (CUDA graph capture failed)",
                                   exc_info=True)  # fmt: skip
                    self.chain = None

    # ---- drafting ------------------------------------------------------------------------------

    def _logits_to_ids(self, out: torch.Tensor) -> torch.Tensor:
        head = self.head
        if head.lm_head is not None:
            return head.draft_to_target[head.lm_head(out).argmax(dim=-1)]
        return self.target.model.compute_logits(out).argmax(dim=-1)

    def _put(self, a: np.ndarray) -> torch.Tensor:
        """``a`` on the device, copied without making the host wait for the device."""
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.ctx.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.ctx.device, non_blocking=True)

    def _tables(self, rows: np.ndarray, max_pos: int) -> np.ndarray:
        """[n, cols] block tables of ``rows`` covering positions ``0..max_pos``: the target's
        blocks, then the row's scratch blocks."""
        bs, t = self.block_size, self.target
        cols = max_pos // bs + 1
        table = np.zeros((len(rows), cols), dtype=np.int64)
        have = min(cols, t.block_table.shape[1])
        table[:, :have] = t.block_table[rows, :have]
        nb = t.num_row_blocks[rows][:, None]
        col = np.arange(cols)[None, :]
        past = col >= nb
        scratch = (
            self.first_scratch
            + rows[:, None] * self.scratch
            + np.minimum(col - nb, self.scratch - 1)
        )
        return np.where(past, scratch, table)

    def _run(
        self,
        tables: np.ndarray,
        positions: np.ndarray,
        qsl: np.ndarray,
        seq_lens: np.ndarray,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.block_size
        n = len(seq_lens)
        req = np.repeat(np.arange(n), np.diff(qsl))
        slots = tables[req, positions // bs] * bs + positions % bs

        def put(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return self._put(a).to(dtype)

        common = CommonAttentionMetadata(
            num_reqs=n,
            num_actual_tokens=len(positions),
            max_query_len=int(np.diff(qsl).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=put(qsl, torch.int32),
            seq_lens=put(seq_lens, torch.int32),
            block_table=put(tables, torch.int32),
            slot_mapping=put(slots, torch.int64),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        pos_t = put(positions, torch.int64)
        with set_forward_context(self.target.attn_backend.build_metadata(common)):
            return self.head(pos_t, self.embed(tokens), hidden)

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch) -> Drafts:
        n = len(batch)
        out = np.full((n, self.k), -1, dtype=np.int64)
        if batch.new_hidden_states is None or self.head is None:
            return Drafts(out)
        m = np.diff(batch.hidden_loc)
        go = np.zeros(n, dtype=bool)
        pieces: list[tuple[int, torch.Tensor]] = []  # the drafting requests' rows to catch up on
        plain = True  # every request drafts, on exactly this call's rows
        for i, req_id in enumerate(batch.req_ids):
            rows = batch.new_hidden_states[batch.hidden_loc[i] : batch.hidden_loc[i + 1]]
            first = int(batch.num_tokens[i]) - 1 - int(m[i])
            st = self._state.get(req_id)
            if st is None:
                st = self._state[req_id] = _Backoff(self.start_pause)
            st.add(first, rows)
            num_tokens = int(batch.num_tokens[i])
            st.score(batch.token_ids[batch.rows[i]], num_tokens)
            ahead = self._ahead.pop(req_id, None) if self._ahead else None
            if st.num_rows and st.should_draft(num_tokens):
                first, rows = st.take()
                if self.resume_at:
                    self.resume_at.pop(req_id, None)
                if ahead is not None and ahead[2] == first and len(rows) == m[i]:
                    # NOTE: drafted on the device behind the step, from exactly these rows.
                    ids = ahead[0][ahead[1]].numpy()
                    out[i, : len(ids)] = ids
                    st.drafted(ids, num_tokens)
                    self.num_drafted_behind += 1
                    plain = False
                    continue
                go[i] = True
                pieces.append((first, rows))
                plain &= len(rows) == m[i]
            else:
                plain = False
                if st.resume > num_tokens:
                    self.resume_at[req_id] = st.resume
        sel = np.flatnonzero(go)
        if not len(sel):
            return Drafts(out)
        hidden = batch.new_hidden_states if plain else torch.cat([r for _, r in pieces])
        m_sel = np.fromiter((len(r) for _, r in pieces), dtype=np.int64, count=len(sel))
        first = np.fromiter((f for f, _ in pieces), dtype=np.int64, count=len(sel))
        ids = self._draft(batch, sel, first, m_sel, hidden)
        out[sel, : ids.shape[1]] = ids
        for j, i in enumerate(sel.tolist()):
            self._state[batch.req_ids[i]].drafted(ids[j], int(batch.num_tokens[i]))
        return Drafts(out)

    def remove(self, req_ids) -> None:
        for req_id in req_ids:
            st = self._state.pop(req_id, None)
            if st is not None and st.scored:
                self.start_pause = 1 if st.misses == 0 else min(st.pause, _MAX_PAUSE)
            self.resume_at.pop(req_id, None)
            self._ahead.pop(req_id, None)
            if self._behind is not None and req_id in self._behind[2]:
                self._behind = None

    @torch.inference_mode()
    def draft_after_verify(self, batch: VerifiedBatch) -> None:
        """Draft for the verified requests on the device, behind the step (the fixed-shape
        chain over the step's rows and its outcome): ``propose`` returns these drafts when the
        step is read, without a draft of its own or a wait."""
        chain = self.chain
        self._behind = None
        if not self.draft_behind or chain is None or self.head is None:
            return
        keep = [
            j
            for j, req_id in enumerate(batch.req_ids)
            if req_id in self._state and not self._state[req_id].num_rows
        ]
        if not keep:
            return
        sel = np.asarray(keep, dtype=np.int64)
        first, m = batch.first[sel], batch.num_rows[sel]
        tables = self._tables(batch.rows[sel], int((first + m).max()) + self.k + 1)
        if not chain.fits(len(sel), m, tables.shape[1]):
            return
        tokens, emitted, hidden = batch.tokens, batch.num_emitted, batch.new_hidden_states
        if len(sel) < len(batch.req_ids):
            loc = batch.hidden_loc
            flat = np.concatenate([np.arange(loc[j], loc[j + 1]) for j in keep])
            hidden = hidden[self._put(flat)]
            sel_t = self._put(sel)
            tokens, emitted = tokens[sel_t], emitted[sel_t]
        b = chain.load_verified(tables, first, m, tokens, emitted, hidden)
        drafts = chain.run(b)[: len(sel)]
        host = drafts.to("cpu", non_blocking=True) if drafts.is_cuda else drafts.clone()
        for j, i in enumerate(keep):
            self._ahead[batch.req_ids[i]] = (host, j, int(first[j]))
        self._behind = (drafts, host, [batch.req_ids[i] for i in keep])

    def drafts_ahead(
        self, req_ids: list[str], num_tokens: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The drafts of the last ``draft_after_verify``, where it drafted for exactly
        ``req_ids`` (in order) and ``propose`` will return them whatever the step accepts: no
        request paused, none with a miss away from pausing."""
        behind = self._behind
        if behind is None or behind[2] != req_ids:
            return None
        for req_id, n in zip(req_ids, num_tokens.tolist()):
            st = self._state.get(req_id)
            if st is None or st.num_rows or req_id in self.resume_at:
                return None
            if st.resume > n or st.misses + 1 >= _PATIENCE:
                return None
        return behind[0], behind[1]

    def _catch_up_head(
        self,
        tables: np.ndarray,
        first: np.ndarray,
        m: np.ndarray,
        tail: np.ndarray,
        qsl: np.ndarray,
        positions: np.ndarray,
        ids: np.ndarray,
        target_hidden: torch.Tensor,
    ) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """Write the head's keys and values for each request's rows but its last ``tail``
        (one eager forward over them); the last rows' ``(ids, first, target_hidden)``."""
        head = m - tail
        row = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], m)  # index within its request
        in_head = row < np.repeat(head, m)
        h_idx, t_idx = np.flatnonzero(in_head), np.flatnonzero(~in_head)
        some = np.flatnonzero(head)
        h_qsl = np.zeros(len(some) + 1, dtype=np.int64)
        np.cumsum(head[some], out=h_qsl[1:])
        hidden = self.head.combine(target_hidden[self._put(h_idx)].to(self.ctx.dtype))
        self._run(
            tables[some], positions[h_idx], h_qsl, first[some] + head[some],
            self._put(ids[h_idx]), hidden,
        )  # fmt: skip
        return ids[t_idx], first + head, target_hidden[self._put(t_idx)]

    def _draft(
        self,
        batch: ProposalBatch,
        sel: np.ndarray,
        first: np.ndarray,
        m_sel: np.ndarray,
        target_hidden: torch.Tensor,
    ) -> np.ndarray:
        """[len(sel), steps] drafts of the requests ``sel``, whose rows ``target_hidden`` (m_sel
        each) hold positions ``first ..`` up to their last known token but one."""
        rows = batch.rows[sel]
        num_tokens = batch.num_tokens[sel]
        steps = int(batch.max_num_drafts[sel].max())
        qsl = np.zeros(len(sel) + 1, dtype=np.int64)
        np.cumsum(m_sel, out=qsl[1:])
        total = int(qsl[-1])
        positions = np.repeat(first, m_sel) + (np.arange(total) - np.repeat(qsl[:-1], m_sel))
        ids = batch.token_ids[np.repeat(rows, m_sel), positions + 1]
        # Catch-up positions, then chain positions num_tokens - 1 .. num_tokens + steps - 3.
        tables = self._tables(rows, int(num_tokens.max()) + steps)
        chain = self.chain
        if chain is not None and steps == self.k:
            # NOTE: a catch-up longer than the chain takes (a prompt, a pause) writes its older
            # rows' keys and values eagerly, then the fixed-shape draft takes the last q rows
            # and drafts: one eager forward and one replay, not k eager forwards.
            tail = np.minimum(m_sel, chain.q)
            if chain.fits(len(sel), tail, tables.shape[1]):
                if (tail < m_sel).any():
                    ids, first, target_hidden = self._catch_up_head(
                        tables, first, m_sel, tail, qsl, positions, ids, target_hidden
                    )
                b = chain.load(tables, first, tail, ids, target_hidden)
                return chain.run(b)[: len(sel)].cpu().numpy()
        hidden = self.head.combine(target_hidden.to(self.ctx.dtype))
        tokens = self._put(ids)
        h, lm_in = self._run(tables, positions, qsl, num_tokens - 1, tokens, hidden)
        last = self._put(qsl[1:] - 1)
        h = h[last]
        draft = self._logits_to_ids(lm_in[last])
        drafts = [draft]
        one = np.arange(len(sel) + 1, dtype=np.int64)
        for s in range(1, steps):
            pos = num_tokens - 2 + s
            h, lm_in = self._run(tables, pos, one, pos + 1, draft, h)
            draft = self._logits_to_ids(lm_in)
            drafts.append(draft)
        return torch.stack(drafts, dim=1).cpu().numpy()


_PATIENCE = 3  # proposals in a row with no draft right before a request pauses
_MAX_PAUSE = 64  # steps


class _Backoff:
    """A request whose drafts keep missing pauses drafting (1, 2, 4 .. 64 steps, then one
    probe), so that a head that does not fit the text costs little; its hidden states wait
    and are caught up on at the next draft. A draft counts as a hit when the target's next
    token equals it, whether or not it was scheduled. ``start_pause`` > 1 (the last request's
    drafts were missing): the first two drafts are probes, and two misses pause that long."""

    __slots__ = ("first", "parts", "num_rows", "last", "at", "misses", "pause", "resume", "scored")

    def __init__(self, start_pause: int = 1) -> None:
        self.first = 0
        self.parts: list[torch.Tensor] = []  # rows of positions first.. not caught up on yet
        self.num_rows = 0
        self.last: np.ndarray | None = None
        self.at = 0
        self.misses = 0
        self.pause = start_pause
        self.resume = 0  # drafts again once the request knows this many tokens
        self.scored = 0  # drafts scored
        if start_pause > 1:  # two probes: a miss on both pauses ``start_pause`` steps
            self.misses = _PATIENCE - 2

    def add(self, first: int, rows: torch.Tensor) -> None:
        """Rows of positions ``first..`` to catch up on: after the waiting ones when they meet,
        else instead of them."""
        if self.parts and self.first + self.num_rows == first:
            self.parts.append(rows)
            self.num_rows += len(rows)
        else:
            self.first, self.parts, self.num_rows = first, [rows], len(rows)

    def take(self) -> tuple[int, torch.Tensor]:
        """The waiting rows (from position ``first``), joined; none wait after."""
        parts, self.parts, self.num_rows = self.parts, [], 0
        return self.first, parts[0] if len(parts) == 1 else torch.cat(parts)

    def score(self, history: np.ndarray, num_tokens: int) -> None:
        if self.last is None or num_tokens <= self.at:
            return
        hit = self.last[0] == history[self.at]
        self.last = None
        self.scored += 1
        if hit:
            self.misses, self.pause = 0, 1
        else:
            self.misses += 1

    def should_draft(self, num_tokens: int) -> bool:
        if num_tokens < self.resume:
            return False
        if self.misses >= _PATIENCE:
            self.resume, self.pause = num_tokens + self.pause, min(2 * self.pause, _MAX_PAUSE)
            self.misses = _PATIENCE - 1  # one more miss after the pause pauses again
            return False
        return True

    def drafted(self, ids: np.ndarray, num_tokens: int) -> None:
        self.last, self.at = ids, num_tokens


class Eagle3Proposer(EagleProposer):
    """``speculative: {method: eagle3, model: HEAD_DIR, num_speculative_tokens: k}``."""

    kind = "eagle3"
