"""The whole draft (catch-up and chain) as one fixed-shape computation, replayed as a CUDA graph.

For decoding requests, a call catches up on at most k + 1 positions a request (the last known
token and the accepted drafts), then drafts k tokens. Padded to ``q = k + 1`` rows a request, the
computation has fixed shapes, so it is captured once per batch-size bucket and replayed: one
launch for the whole draft instead of a few hundred small ones, and no attention planning.
Attention is a plain masked softmax over each request's gathered blocks (a fixed number of
them: the cost grows with the context limit, so this path serves small batches and contexts;
the rest drafts eagerly through the target's attention backend).

The head's cache is the backend's default layout, ``[2, num_blocks, block_size, kv_heads,
head_dim]``: keys at [0], values at [1]. Pad rows write to a block no request holds.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pagoda_spec_eagle.draft import EagleHead

# Gathered context positions (requests x positions) above which drafting stays eager.
MAX_GATHERED = 1 << 16
BUCKETS = (1, 2, 4, 8)


class DenseChain:
    def __init__(
        self,
        head: EagleHead,
        logits_to_ids,
        embed,
        k: int,
        width: int,
        block_size: int,
        trash_block: int,
        hidden_in: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.head, self.logits_to_ids, self.embed = head, logits_to_ids, embed
        self.k, self.q, self.width, self.bs = k, k + 1, width, block_size
        self.trash = trash_block
        self.device = device
        self.max_batch = max(b for b in BUCKETS if b * width * block_size <= MAX_GATHERED or b == 1)
        b, q = self.max_batch, self.q
        # NOTE: the integer inputs are views of one buffer, filled by one copy a call. Each
        # request's rows to keep (``count``: its first ``count`` rows, 0 for a pad) decide which
        # rows write the cache and which one drafts, inside the computation: a call fills one
        # number a request, not masks.
        self.sizes = [b * q, b * q, b, b * width]
        self.ints = torch.zeros(sum(self.sizes), dtype=torch.int64, device=device)
        tokens, positions, count, table = self.ints.split(self.sizes)
        self.tokens, self.positions = tokens.view(b, q), positions.view(b, q)
        self.count, self.table = count, table.view(b, width)
        self.cols = torch.arange(q, device=device)
        self._offsets = np.cumsum(self.sizes)[:-1].tolist()  # where each input starts, on the host
        self._steps = np.arange(q)[None, :]
        # NOTE: the host side of that copy: two buffers (page-locked on a GPU), a call each in
        # turn, so that no call pins memory of its own (tens of microseconds of host time a
        # call); an event says when a buffer's last copy has run (long before its next turn).
        cuda = device.type == "cuda"
        self._stage = [
            torch.zeros(sum(self.sizes), dtype=torch.int64, pin_memory=cuda) for _ in range(2)
        ]
        self._left = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._turn = 0
        self.hidden = torch.zeros(b, q, hidden_in, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.runs = 0

    def fits(self, n: int, m: np.ndarray, cols: int) -> bool:
        return n <= self.max_batch and int(m.max()) <= self.q and cols <= self.width

    # ---- the computation ----------------------------------------------------------------------

    def _attend(self, b: int, rows: int, positions: torch.Tensor, slots: torch.Tensor):
        """The head's attention over the paged cache for ``b`` requests of ``rows`` rows each."""
        cache = self.head.attn.kv_cache
        kv, hd = cache.shape[-2], cache.shape[-1]
        table = self.table[:b]
        span = self.width * self.bs
        key_pos = torch.arange(span, device=self.device)
        # Causal: row at position p sees the request's slots at positions 0..p.
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [b, rows, span]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache = cache[0].view(-1, kv, hd)
            v_cache = cache[1].view(-1, kv, hd)
            k_cache.index_copy_(0, slots, k.reshape(-1, kv, hd))
            v_cache.index_copy_(0, slots, v.reshape(-1, kv, hd))
            keys = cache[0][table].reshape(b, span, kv, hd).transpose(1, 2)
            values = cache[1][table].reshape(b, span, kv, hd).transpose(1, 2)
            nh = q.shape[1]
            qh = q.reshape(b, rows, kv, nh // kv, hd).permute(0, 2, 1, 3, 4)
            qh = qh.reshape(b, kv, rows * (nh // kv), hd)
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=self.device)
            bias = bias.masked_fill(~mask, float("-inf"))
            bias = bias.repeat_interleave(nh // kv, dim=1)[:, None]  # [b, 1, rows * g, span]
            o = torch.nn.functional.scaled_dot_product_attention(
                qh, keys, values, attn_mask=bias, scale=hd**-0.5
            )
            o = o.reshape(b, kv, rows, nh // kv, hd).permute(0, 2, 1, 3, 4)
            return o.reshape(b * rows, nh, hd)

        return attend

    def _slots(self, b: int, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        cols = (positions // self.bs).clamp(max=self.width - 1)
        block = self.table[:b].gather(1, cols)
        block = torch.where(valid, block, torch.full_like(block, self.trash))
        return (block * self.bs + positions % self.bs).reshape(-1)

    def compute(self, b: int) -> torch.Tensor:
        """Drafts [b, k] for the first ``b`` rows of the input buffers."""
        head, q = self.head, self.q
        pos = self.positions[:b]
        count = self.count[:b]
        valid = self.cols[None, :] < count[:, None]
        last = (count - 1).clamp(min=0)
        attend = self._attend(b, q, pos, self._slots(b, pos, valid))
        hidden = head.combine(self.hidden[:b].reshape(b * q, -1))
        tokens = self.tokens[:b].reshape(-1).clamp(min=0)  # -1 pads a verified step's tokens
        h, lm_in = head(pos.reshape(-1), self.embed(tokens), hidden, attend)
        pick = torch.arange(b, device=self.device) * q + last
        h = h[pick]
        draft = self.logits_to_ids(lm_in[pick])
        drafts = [draft]
        base = pos.gather(1, last[:, None])  # [b, 1]: the last caught-up position
        ones = torch.ones(b, 1, dtype=torch.bool, device=self.device)
        for s in range(1, self.k):
            p = base + s
            attend = self._attend(b, 1, p, self._slots(b, p, ones))
            h, lm_in = head(p.reshape(-1), self.embed(draft), h, attend)
            draft = self.logits_to_ids(lm_in)
            drafts.append(draft)
        return torch.stack(drafts, dim=1)

    # ---- inputs, capture, replay -------------------------------------------------------------

    def load(
        self,
        tables: np.ndarray,
        first: np.ndarray,
        m: np.ndarray,
        tokens: np.ndarray,
        hidden: torch.Tensor,
    ) -> int:
        """Fill the input buffers for ``n`` requests whose ``m`` rows start at positions
        ``first`` (``tokens``: their input ids, flat; ``hidden``: their target rows, flat);
        returns the bucket."""
        return self._load(tables, first, m, hidden, tokens)

    def load_verified(
        self,
        tables: np.ndarray,
        first: np.ndarray,
        m: np.ndarray,
        tokens: torch.Tensor,
        num_emitted: torch.Tensor,
        hidden: torch.Tensor,
    ) -> int:
        """``load`` for requests just verified, whose outcome is on the device only: ``m``
        rows each from ``first`` were computed, of which ``num_emitted`` [n] are kept, and
        ``tokens`` [n, <= q] (-1 padded) are their input ids."""
        b = self._load(tables, first, m, hidden, None)
        n, w = tokens.shape
        self.tokens[:n, :w] = tokens
        self.count[:n] = num_emitted
        return b

    def _load(
        self,
        tables: np.ndarray,
        first: np.ndarray,
        m: np.ndarray,
        hidden: torch.Tensor,
        tokens: np.ndarray | None,
    ) -> int:
        n, q = len(m), self.q
        b = self.bucket(n)
        full = n == b and int(m.min()) == q  # every row of the bucket holds a request's row
        self._turn = turn = 1 - self._turn
        if self._left is not None and not self._left[turn].query():
            self._left[turn].synchronize()
        host = self._stage[turn].numpy()
        host[:] = 0
        o = self._offsets
        tok, count = host[: o[0]], host[o[1] : o[2]]
        pos = host[o[0] : o[1]].reshape(-1, q)
        table = host[o[2] :].reshape(-1, self.width)
        if full:
            idx = None
            if tokens is not None:
                tok[: n * q] = tokens
            pos[:n] = first[:, None] + self._steps
        else:
            idx = np.repeat(np.arange(n) * q, m) + (
                np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)
            )
            if tokens is not None:
                tok[idx] = tokens
            pos[:n] = first[:, None] + np.minimum(self._steps, (m - 1)[:, None])
        count[:n] = m
        table[:] = self.trash
        table[:n, : tables.shape[1]] = tables
        self.ints.copy_(self._stage[turn], non_blocking=True)
        if self._left is not None:
            self._left[turn].record()
        rows = self.hidden[:b].view(b * q, -1)
        if full:
            rows.copy_(hidden)
        else:
            rows.zero_()
            rows[self._pinned(idx).to(self.device, non_blocking=True)] = hidden.to(rows.dtype)
        return b

    def _pinned(self, a: np.ndarray) -> torch.Tensor:
        """``a`` as a tensor to copy from without waiting (pinned on a GPU: a block the host
        allocator keeps until the copy has run)."""
        t = torch.from_numpy(a)
        return t.pin_memory() if self.device.type == "cuda" else t

    def bucket(self, n: int) -> int:
        return next(b for b in BUCKETS if b >= n) if self.graphs else n

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        self.table.fill_(self.trash)
        for b in reversed([b for b in BUCKETS if b <= self.max_batch]):
            self.compute(b)  # warm-up (kernels compiled and tuned)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.compute(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def run(self, b: int) -> torch.Tensor:
        self.runs += 1
        if b in self.graphs:
            self.replays += 1
            self.graphs[b].replay()
            return self.outputs[b]
        return self.compute(b)


def table_width(max_model_len: int, k: int, block_size: int, scratch: int) -> int:
    return math.ceil((max_model_len + 2 * k + 2) / block_size) + scratch
